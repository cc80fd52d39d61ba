"""The 4-rank half of bench/long_context.py: the named layouts, one step of a layout on 4 gloo ranks
in spawned processes (each rank's peak memory, AdamW bytes and expert-row shares), and the
replicated-AdamW comparison. The driver and the one-step helpers it shares stay in long_context.py.
"""

from __future__ import annotations

import os
import queue as queue_mod

import torch

# 4-rank layouts: name -> (config overrides, what it shows), 4 gloo ranks, --multi-recompute.
LAYOUTS = {
    "cp4": (["parallel.cp=4", "parallel.cp_backend=ring", "parallel.ep=4",
             "parallel.distributed_optimizer=true"],
            "CP4 ring, EP4 (Parallel Folding), distributed optimizer"),
    "cp2tp2": (["parallel.cp=2", "parallel.cp_backend=ring", "parallel.tp=2",
                "parallel.sequence_parallel=true", "parallel.ep=4",
                "parallel.distributed_optimizer=true"],
               "CP2 ring x TP2 with sequence parallelism, EP4, distributed optimizer"),
    "cp4_plain": (["parallel.cp=4", "parallel.cp_backend=ring"],
                  "CP4 ring, every expert on every rank, replicated AdamW"),
}
WORLD = 4


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def optimizer_bytes(optimizer, expert_ids: set[int]) -> dict:
    """Bytes of every tensor in `optimizer.state` (exp_avg, exp_avg_sq, step), split by whether
    the parameter is an expert's. A DistributedOptimizer's state is keyed by slab views: its
    `slab_of` names the parameter."""
    out = {"total": 0, "dense": 0, "expert": 0}
    slab_of = getattr(optimizer, "slab_of", lambda t: None)
    for key, state in optimizer.state.items():
        slab = slab_of(key)
        param = slab.param if slab is not None else key
        n = sum(tensor_bytes(t) for t in state.values() if torch.is_tensor(t))
        out["total"] += n
        out["expert" if id(param) in expert_ids else "dense"] += n
    return out


def replicated_optimizer_bytes(trainer, expert_ids: set[int]) -> dict:
    """The state a replicated AdamW (optim.build_optimizer, as parallel.distributed_optimizer=false
    builds it) holds over this rank's parameters, measured: built and stepped once on zero
    gradients. Run after the measured step (it changes the weights and allocates)."""
    from longctx_moe.optim import build_optimizer

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = build_optimizer(trainer.model, trainer.cfg.optim)
    opt.step()
    out = optimizer_bytes(opt, expert_ids)
    for p, g in zip(params, saved, strict=True):
        p.grad = g
    del opt
    return out


def layout_sets(layout: str, spare_slots: int) -> list[str]:
    """The layout's settings, with expert lending where it has an EP group to lend over."""
    sets = LAYOUTS[layout][0]
    ep = int(next((x.split("=")[1] for x in sets if x.startswith("parallel.ep=")), 1))
    return sets + ([f"parallel.ep_spare_slots={spare_slots}"] if spare_slots and ep > 1 else [])


def multi_rank(rank: int, layout: str, port: int, length: int, threads: int, cap_gib: float,
               allocator: str, routes: str, recompute: str, spare_slots: int, queue) -> None:
    import torch.distributed as dist

    # the one-step helpers the single-rank side uses (imported here: long_context imports this module)
    from long_context import (
        CPU,
        GIB,
        bench_config,
        measured_step,
        rss_bytes,
        start_watchdog,
        step_fn,
    )

    from longctx_moe.build import build_runtime
    from longctx_moe.host import configure_cpu
    from longctx_moe.parallel.dims import ParallelDims, destroy_process_groups
    from longctx_moe.trainer import Trainer

    configure_cpu(threads, allocator)
    start_watchdog(int(cap_gib * GIB))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cfg = bench_config(recompute, layout_sets(layout, spare_slots))
    dims = ParallelDims.from_config(cfg.parallel, WORLD, cfg.model)
    dims.build_groups(rank)
    base = rss_bytes()
    trainer = Trainer(cfg, build_runtime(cfg, dims, CPU))
    res = measured_step(step_fn(trainer, routes), length, cfg.model.vocab_size, base)
    expert_ids = {id(p) for p in trainer.runtime.expert}
    params = [p for p in trainer.model.parameters()]
    res.update(
        param_bytes=sum(tensor_bytes(p) for p in params),
        expert_param_bytes=sum(tensor_bytes(p) for p in params if id(p) in expert_ids),
        optimizer_bytes=optimizer_bytes(trainer.optimizer, expert_ids),
        replicated_optimizer_bytes=replicated_optimizer_bytes(trainer, expert_ids),
        replicas={"dense": dims.size("dp_cp"), "expert": dims.size("edp")},
        local_tokens=length // dims.size("cp"), ep=dims.ep,
        # with lending: the rows each EP rank ran per MoE layer (the plan's, the same on all ranks)
        ep_rank_rows=[getattr(m.dispatcher, "rank_rows", None) for m in trainer.model.moe_layers()])
    queue.put((rank, res))
    dist.barrier()
    destroy_process_groups()


def run_multi(layout: str, length: int, threads: int, cap_gib: float, allocator: str,
              routes: str = "live", recompute: str = "none", spare_slots: int = 0) -> dict:
    """One step of `layout` on WORLD gloo ranks (spawned processes); a dict with per-rank rows,
    or with "error" (a rank died or passed its share of the memory cap)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=multi_rank, args=(r, layout, port, length, threads, cap_gib, allocator, routes,
                                                         recompute, spare_slots, queue))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    row = {"layout": layout, "length": length, "sets": layout_sets(layout, spare_slots), "recompute": recompute}
    while len(results) < len(procs):
        try:
            rank, res = queue.get(timeout=5)
            results[rank] = res
        except queue_mod.Empty:  # a rank that died would leave the others waiting forever
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                for p in procs:
                    p.kill()
                code = procs[dead[0]].exitcode
                why = "over its share of --mem-cap-gib" if code == 3 else "see its traceback above"
                return row | {"error": f"rank {dead[0]} exited with {code} ({why})"}
    for p in procs:
        p.join()
    per_rank = [results[r] for r in range(WORLD)]
    peaks = [r["peak_bytes"] for r in per_rank]
    counts = per_rank[0]["expert_counts"]  # the step's global counts, the same on every rank
    ran = per_rank[0]["ep_rank_rows"]
    return row | {
        "ep_rank_shares": ep_rank_shares(counts, per_rank[0]["ep"]) if counts else None,
        "ep_rank_run_shares": ([[n / max(sum(r), 1) for n in r] for r in ran]
                               if ran and all(r is not None for r in ran) else None),
        "per_rank": per_rank, "max_peak_bytes": max(peaks), "min_peak_bytes": min(peaks),
        "step_s": max(r["step_s"] for r in per_rank),
        "optimizer_bytes": max(r["optimizer_bytes"]["total"] for r in per_rank),
        "replicated_optimizer_bytes": max(r["replicated_optimizer_bytes"]["total"] for r in per_rank),
        "replicas": per_rank[0]["replicas"]}


def ep_rank_shares(counts_LE: list[list[int]], ep: int) -> list[list[float]]:
    """Per MoE layer, the share of the routed rows each EP rank's experts received (EP rank r
    holds the r-th contiguous block of experts)."""
    c_LE = torch.tensor(counts_LE, dtype=torch.float64)
    per_rank = c_LE.view(c_LE.shape[0], ep, -1).sum(-1)
    return (per_rank / per_rank.sum(-1, keepdim=True)).tolist()
