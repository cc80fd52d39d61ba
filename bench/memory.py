"""Benchmark: what a trainer rank holds and moves for RL on gloo ranks (CPU), by section.

Each section runs its layouts on every world size of `--world` and returns its table and its JSON
keys; `--sections` picks them (default: all). Sections:

  weight_sync   the bytes a rank sends per weight sync. Before: the whole-tensor export
                (rl_hooks.export.export_weights), where every rank yields every HF tensor
                (the model's bytes) after the all-gathers over TP / ETP / EP that assemble them
                (what the rank sends into those, in the parameters' dtype, counted from the
                declared splits: (group size - 1) x its piece per gather). After: the per-shard
                export (export_weight_shards), each rank's own pieces, no gathers.
                `shard_sync_bytes_ratio`: the worst rank's shard bytes over model bytes / world,
                the worst over every run (acceptance: <= 1.1).
  offload       device bytes a rank holds after PolicyTrainer.offload() over before, on the
                gloo ranks (the trainer's storages, copies forced on the CPU) and in the full-size
                rehearsal of Qwen3-30B-A3B on 8 (every storage alive on the device).
                `offload_residual_frac`: the worst (acceptance: <= 0.02).
  bf16_params   parameter bytes a rank holds with train.param_dtype=bf16 over fp32 (distributed
                optimizer on), and the fp32 masters its optimizer then holds: on the gloo ranks,
                and in the full-size rehearsal of Qwen3-30B-A3B on 8 (rank 0: the peak split's
                parameters). `bf16_param_bytes_ratio`: the rehearsal's (the models people
                train, whose fp32 embedding, router and norms are a small part);
                `bf16_param_bytes_ratio_gloo`: the worst gloo rank's over every run (the tiny
                config's fp32 embedding is 27% of it: 0.70 there).
  optim_offload the optimizer's device bytes with optim.offload=cpu against none, per rank: on
                the gloo ranks after one step (AdamW's state and separate masters the device
                optimizer holds, what stays on the device with offload, what the host holds), and
                in the full-size rehearsals of Qwen3-30B-A3B on 8, Mixtral-8x22B on 32 and
                gpt-oss-120b on 16 (rank 0, 32K tokens of RL-like lengths, H100): the peak split's
                optimizer state and the peak, none against cpu, and whether it fits 80 GB.
                `optimizer_device_bytes_offloaded`: Qwen3-30B-A3B on 8's rehearsed rank.

Layouts (of --config, configs/tiny_cpu.yaml by default): ep (experts over every rank, DP for the
rest), tp2 (TP 2 x DP, experts replicated), tp2-ep2 (with EDP replicas), tp2-ep2-etp2 (experts'
hidden units split too); a layout the world or the model cannot take is skipped with a line.

    python bench/memory.py --world 4 8 --out runs/bench/memory.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from tests.launcher import run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYOUTS = {
    "ep": lambda world: [f"parallel.ep={world}"],
    "tp2": lambda world: ["parallel.tp=2"],
    "tp2-ep2": lambda world: ["parallel.tp=2", "parallel.ep=2"],
    "tp2-ep2-etp2": lambda world: ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"],
}


# ---------------------------------------------------------------------- weight_sync


def gather_bytes_sent(model, dims) -> int:
    """Bytes this rank sends into the whole-tensor export's all-gathers (longctx_moe.hf.weights:
    a TP-split tensor over tp; an expert tensor over etp, then the etp-whole one over ep), each
    in the parameter's dtype: (group size - 1) x the rank's piece per gather."""
    from longctx_moe.hf.families import family_of
    from longctx_moe.hf.interop import fused_pairs, name_pairs
    from longctx_moe.parallel.sharding import splits_of

    cfg = model.cfg
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = [ours for ours, _ in name_pairs(cfg)]
    for layer in range(cfg.first_k_dense, cfg.num_layers):
        if family_of(cfg.hf_family).fused_experts:
            names += [ours for ours, _ in fused_pairs(cfg, layer)]
        else:
            names += [f"layers.{layer}.ffn.experts.{w}" for w in ("w_gate_up", "w_down")]
    sent = 0
    for name in names:
        p = tensors[name]
        size = p.numel() * p.element_size()
        parts = {s.axis: s.parts for s in splits_of(p)}
        for axis in ("tp", "etp", "ep"):  # hf.weights' order of the gathers
            n = dims.size(axis) if axis in parts else 1
            sent += size * (n - 1)
            size *= n
    return sent


def _sync_rank(rank: int, world: int, config: str, layouts: list[tuple[str, list[str]]], dtype_name: str) -> list[dict]:
    from longctx_moe.config import load_config
    from rl_hooks import PolicyTrainer

    dtype = DTYPES[dtype_name]
    out = []
    for _, sets in layouts:
        policy = PolicyTrainer(load_config(config, sets))
        whole = sum(t.numel() * t.element_size() for bucket in policy.export_weights(dtype=dtype) for _, t in bucket)
        shard = sum(r.nbytes for r in policy.export_weight_shards(dtype))
        spec = policy.weights_spec(dtype)
        out.append({"before_yield_bytes": whole, "before_gather_sent_bytes": gather_bytes_sent(policy.runtime.model, policy.dims),
                    "after_bytes": shard,
                    "model_bytes": sum(s.dtype.itemsize * _numel(s.shape) for s in spec)})
    return out


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _layouts_for(world: int, names: list[str], config: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(name, settings) of the layouts `world` ranks and the model can take; lines for the others."""
    from longctx_moe.config import ConfigError, load_config
    from longctx_moe.parallel.dims import ParallelDims

    keep, skipped = [], []
    for name in names:
        sets = LAYOUTS[name](world)
        try:
            cfg = load_config(config, sets)
            ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
        except (ConfigError, ValueError) as e:
            skipped.append(f"skipped {name} on {world} ranks: {e}")
            continue
        keep.append((name, sets))
    return keep, skipped


def _per_layout(args, rank_fn, *extra) -> tuple[list[str], list[tuple[int, str, list[str], list]]]:
    """(skip lines, [(world, layout name, its settings, each rank's result)]): `rank_fn(rank,
    world, config, layouts, *extra)` on gloo ranks, once per world size, over the layouts that
    world takes; it returns one result per layout."""
    lines, out = [], []
    for world in args.world:
        layouts, skipped = _layouts_for(world, args.layouts, args.config)
        lines += skipped
        if layouts:
            per_rank = run_distributed(rank_fn, world, args=(args.config, layouts, *extra), timeout=1800)
            out += [(world, name, sets, [r[i] for r in per_rank]) for i, (name, sets) in enumerate(layouts)]
    return lines, out


def weight_sync(args) -> tuple[list[str], dict]:
    lines, per_layout = _per_layout(args, _sync_rank, args.dtype)
    runs = []
    for world, name, sets, ranks in per_layout:
        model = ranks[0]["model_bytes"]
        fair = model / world
        runs.append({"world": world, "layout": name, "settings": sets, "model_bytes": model,
                     "ranks": [{k: v for k, v in r.items() if k != "model_bytes"} for r in ranks],
                     "before_max_bytes": max(r["before_yield_bytes"] + r["before_gather_sent_bytes"] for r in ranks),
                     "after_max_bytes": max(r["after_bytes"] for r in ranks),
                     "after_min_bytes": min(r["after_bytes"] for r in ranks),
                     "shard_sync_bytes_ratio": max(r["after_bytes"] for r in ranks) / fair})
    ratio = max((r["shard_sync_bytes_ratio"] for r in runs), default=None)
    return lines + _sync_table(runs, args.dtype), {"shard_sync_bytes_ratio": ratio,
                                                   "weight_sync": {"config": args.config, "dtype": args.dtype, "runs": runs}}


def _sync_table(runs: list[dict], dtype: str) -> list[str]:
    kib = 1024
    lines = [f"weight sync, bytes a rank sends per sync ({dtype} export; KiB; fair = model / world)",
             f"{'world':>5} {'layout':<13} {'rank':>4} {'before: yield':>13} {'+ gathers':>10} "
             f"{'after':>9} {'after/fair':>10}"]
    for run in runs:
        fair = run["model_bytes"] / run["world"]
        for rank, r in enumerate(run["ranks"]):
            lines.append(f"{run['world']:>5} {run['layout']:<13} {rank:>4} {r['before_yield_bytes'] / kib:>13.1f} "
                         f"{r['before_gather_sent_bytes'] / kib:>10.1f} {r['after_bytes'] / kib:>9.1f} "
                         f"{r['after_bytes'] / fair:>10.3f}")
    lines.append(f"{'world':>5} {'layout':<13} {'model':>9} {'fair':>9} {'before max':>10} {'after max':>9} "
                 f"{'after min':>9} {'ratio':>6} {'before/after':>12}")
    for run in runs:
        lines.append(f"{run['world']:>5} {run['layout']:<13} {run['model_bytes'] / kib:>9.1f} "
                     f"{run['model_bytes'] / run['world'] / kib:>9.1f} {run['before_max_bytes'] / kib:>10.1f} "
                     f"{run['after_max_bytes'] / kib:>9.1f} {run['after_min_bytes'] / kib:>9.1f} "
                     f"{run['shard_sync_bytes_ratio']:>6.3f} {run['before_max_bytes'] / run['after_max_bytes']:>12.1f}")
    return lines


# ---------------------------------------------------------------------- bf16_params


def _param_rank(rank: int, world: int, config: str, layouts: list[tuple[str, list[str]]]) -> list[dict]:
    """Per layout and train.param_dtype: bytes of the parameters this rank holds, and of the
    separate fp32 masters its (distributed) optimizer holds."""
    from longctx_moe.build import build_runtime, check_layout
    from longctx_moe.config import load_config
    from longctx_moe.trainer import Trainer

    out = []
    for _, sets in layouts:
        row = {}
        for dtype in ("fp32", "bf16"):
            cfg = load_config(config, [*sets, f"train.param_dtype={dtype}", "train.autocast_dtype=bf16",
                                       "parallel.distributed_optimizer=true"])
            dims = check_layout(cfg, world)
            dims.build_groups(rank)
            trainer = Trainer(cfg, build_runtime(cfg, dims, torch.device("cpu")))
            inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            owned = {id(p) for p in trainer.model.parameters()}
            masters = [m for g in inner.param_groups for m in g["params"] if id(m) not in owned
                       and getattr(inner, "param_of", lambda t: t)(m) is not m]
            row[f"{dtype}_param_bytes"] = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
            row[f"{dtype}_master_bytes"] = sum(m.numel() * m.element_size() for m in masters)
        out.append(row)
    return out


# The full-size rehearsal of train.param_dtype: Qwen3-30B-A3B on 8, rank 0 (the parameters do not
# depend on the tokens: 4,096 of them keep each run near a CPU-minute).
PARAM_REHEARSAL = ["--config", "configs/rehearsal/qwen3-30b-a3b.yaml", "--world", "8", "--rank", "0",
                   "--tokens", "4096", "--gpu", "h100"]


def _rehearsed_report(args: list[str]) -> dict:
    """The one rank's report of `longctx-moe rehearse ARGS`, run as its own process."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "longctx_moe.cli", "rehearse", *args, "--out", f"{tmp}/r.json"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode not in (0, 1):  # 1: the rank does not fit its GPU, reported all the same
            raise RuntimeError(f"rehearse failed ({done.returncode}): {done.stderr[-2000:]}")
        (report,) = json.load(open(f"{tmp}/r.json"))["ranks"]
    return report


def _rehearsed_params() -> dict:
    """{dtype: the peak split's parameters and optimizer state} of PARAM_REHEARSAL, and the ratio."""
    out = {}
    for dtype in ("fp32", "bf16"):
        split = _rehearsed_report([*PARAM_REHEARSAL, "--set", f"train.param_dtype={dtype}"])["peak_split"]
        out[dtype] = {"param_bytes": split["parameters"], "optimizer_state_bytes": split["optimizer state"]}
    out["ratio"] = out["bf16"]["param_bytes"] / out["fp32"]["param_bytes"]
    return out


def bf16_params(args) -> tuple[list[str], dict]:
    """Parameter bytes per rank with train.param_dtype=bf16 over fp32 (the distributed optimizer
    on; the embedding, router and norms stay fp32: longctx_moe.precision.low_precision_params):
    `bf16_param_bytes_ratio` the full-size rehearsal's, `bf16_param_bytes_ratio_gloo` the worst
    gloo rank's (module docstring)."""
    lines, per_layout = _per_layout(args, _param_rank)
    runs = [{"world": world, "layout": name, "settings": sets, "ranks": ranks,
             "ratio": max(r["bf16_param_bytes"] / r["fp32_param_bytes"] for r in ranks)}
            for world, name, sets, ranks in per_layout]
    kib = 1024
    lines += ["parameters per rank, train.param_dtype fp32 -> bf16 (KiB; masters: the optimizer's fp32 copies)",
              f"{'world':>5} {'layout':<13} {'rank':>4} {'fp32 params':>11} {'bf16 params':>11} "
              f"{'bf16 masters':>12} {'ratio':>6}"]
    for run in runs:
        for rank, r in enumerate(run["ranks"]):
            lines.append(f"{run['world']:>5} {run['layout']:<13} {rank:>4} {r['fp32_param_bytes'] / kib:>11.1f} "
                         f"{r['bf16_param_bytes'] / kib:>11.1f} {r['bf16_master_bytes'] / kib:>12.1f} "
                         f"{r['bf16_param_bytes'] / r['fp32_param_bytes']:>6.3f}")
    ratio = max((r["ratio"] for r in runs), default=None)
    rehearsed, gib = _rehearsed_params(), 2 ** 30
    lines.append(f"rehearsed {' '.join(PARAM_REHEARSAL)}: parameters {rehearsed['fp32']['param_bytes'] / gib:.2f} "
                 f"-> {rehearsed['bf16']['param_bytes'] / gib:.2f} GiB (ratio {rehearsed['ratio']:.3f}), "
                 f"optimizer state {rehearsed['fp32']['optimizer_state_bytes'] / gib:.2f} -> "
                 f"{rehearsed['bf16']['optimizer_state_bytes'] / gib:.2f} GiB (the masters)")
    return lines, {"bf16_param_bytes_ratio": rehearsed["ratio"], "bf16_param_bytes_ratio_gloo": ratio,
                   "bf16_params": {"config": args.config, "runs": runs, "rehearsal": rehearsed,
                                   "rehearsal_args": PARAM_REHEARSAL}}


# ---------------------------------------------------------------------- offload

# The full-size rehearsal of the offload: Qwen3-30B-A3B GRPO on 8 ranks (rank 3, 4096 tokens a
# rank), rl_hooks/rehearsal/policy_step.py's offload phase.
OFFLOAD_REHEARSAL = ["--config", "configs/rehearsal/qwen3-30b-a3b.yaml", "--world", "8", "--rank", "3",
                     "--tokens", "4096", "--gpu", "h100", "--rl", "shards"]


def _offload_rank(rank: int, world: int, config: str, layouts: list[tuple[str, list[str]]]) -> list[dict]:
    """Per layout, after one GRPO step: the trainer's device bytes before and after offload(),
    with the copies forced on this CPU (rl_hooks/offload.py: a CPU run moves nothing otherwise)."""
    from longctx_moe.config import load_config
    from rl_hooks import PolicyLossConfig, PolicyTrainer, make_loss
    from rl_hooks.rehearsal.policy_step import rollouts

    out = []
    for _, sets in layouts:
        policy = PolicyTrainer(load_config(config, [*sets, "parallel.distributed_optimizer=true"]))
        policy.train_step(rollouts([24, 40] * policy.dims.dp), make_loss(PolicyLossConfig(kind="ppo")))
        residency = policy.export_gate.residency
        residency.moves = True
        before = residency.device_bytes()
        sent = policy.offload()
        out.append({"before_bytes": before, "after_bytes": residency.device_bytes(), "sent": sent})
        policy.onload()
    return out


def _offload_rehearsed() -> dict:
    return _rehearsed_report(OFFLOAD_REHEARSAL)["phases"]["offload"]


def offload(args) -> tuple[list[str], dict]:
    """Device bytes a rank holds after offload() over before. On gloo ranks the trainer's own
    storages (the walk the offload makes: proves it frees what it finds); in the rehearsal every
    storage alive on the device, as torch.cuda.memory_allocated counts (what it did not find
    shows there). `offload_residual_frac`: the worst of them (acceptance: <= 0.02)."""
    lines, per_layout = _per_layout(args, _offload_rank)
    runs = [{"world": world, "layout": name, "ranks": ranks} for world, name, _, ranks in per_layout]
    rehearsed = _offload_rehearsed()
    gib, kib = 2 ** 30, 1024
    lines += ["offload: device bytes a rank holds before and after offload() (gloo: KiB)",
              f"{'world':>5} {'layout':<13} {'rank':>4} {'before':>9} {'after':>7} {'frac':>6}"]
    fracs = []
    for run in runs:
        for rank, r in enumerate(run["ranks"]):
            fracs.append(r["after_bytes"] / max(r["before_bytes"], 1))
            lines.append(f"{run['world']:>5} {run['layout']:<13} {rank:>4} {r['before_bytes'] / kib:>9.1f} "
                         f"{r['after_bytes'] / kib:>7.1f} {fracs[-1]:>6.3f}")
    fracs.append(rehearsed["offload_residual_frac"])
    lines.append(f"rehearsed {' '.join(OFFLOAD_REHEARSAL)}: {rehearsed['device_bytes_before'] / gib:.2f} GiB "
                 f"before, {rehearsed['device_bytes_after'] / gib:.2f} GiB after, "
                 f"frac {rehearsed['offload_residual_frac']:.4f}")
    return lines, {"offload_residual_frac": max(fracs),
                   "offload": {"config": args.config, "runs": runs, "rehearsal": rehearsed,
                               "rehearsal_args": OFFLOAD_REHEARSAL}}


# ---------------------------------------------------------------------- optim_offload

# (name, world, config): the full-size rehearsals, the first the JSON key's
OPTIM_OFFLOAD_REHEARSALS = [("qwen3-30b-a3b", 8, "configs/rehearsal/qwen3-30b-a3b.yaml"),
                            ("mixtral-8x22b", 32, "configs/rehearsal/mixtral-8x22b-32.yaml"),
                            ("gpt-oss-120b", 16, "configs/rehearsal/gpt-oss-120b-16.yaml")]


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _optimizer_rank(rank: int, world: int, config: str, layouts: list[tuple[str, list[str]]]) -> list[dict]:
    """Per layout, after one step with optim.offload none and cpu: the bytes of AdamW's state and
    the separate masters the device optimizer holds; with cpu what the optimizer holds on the
    device (the bf16 slabs' gradient stand-ins) and on the host (masters, state, gradient
    buffers). On this CPU both are host memory: told apart by who made them."""
    from longctx_moe.build import build_runtime, check_layout
    from longctx_moe.config import load_config
    from longctx_moe.optim_offload import HostAdamW
    from longctx_moe.trainer import Trainer
    from tests.trainer.toy import ToyStepLoader

    out = []
    for _, sets in layouts:
        row = {}
        for offload in ("none", "cpu"):
            cfg = load_config(config, [*sets, "parallel.distributed_optimizer=true", f"optim.offload={offload}"])
            dims = check_layout(cfg, world)
            dims.build_groups(rank)
            trainer = Trainer(cfg, build_runtime(cfg, dims, torch.device("cpu")))
            loader = ToyStepLoader(vocab=cfg.model.vocab_size, rank=dims.rank_in("dp"))
            trainer.train_step(loader.step_batches(0))
            inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "slabs") else trainer.optimizer
            state = [v for st in inner.state.values() for v in st.values()]
            if isinstance(inner, HostAdamW):
                row["host_bytes"] = _storage_bytes([*state, *inner.masters, *inner._grads])
                row["cpu_device_bytes"] = _storage_bytes(inner._slots.values())
            else:
                masters = [m for g in inner.param_groups for m in g["params"]
                           if getattr(inner, "param_of", lambda t: t)(m) is not m]
                row["none_device_bytes"] = _storage_bytes([*state, *masters])
        row["offloaded_bytes"] = row["none_device_bytes"] - row["cpu_device_bytes"]
        out.append(row)
    return out


def _rehearse_offload(config: str, world: int, offload: str) -> dict:
    """The report of rank 0 of `config` on `world` with optim.offload=`offload` (bench/rehearsal.py's
    tokens and lengths)."""
    tokens = 32768
    report = _rehearsed_report(["--config", config, "--world", str(world), "--rank", "0", "--gpu", "h100",
                                "--tokens", str(tokens), "--lengths", f"lognormal:1500,1.2,{tokens}",
                                "--set", f"optim.offload={offload}"])
    keep = ("peak_bytes", "host_bytes", "peak_split", "peak_moment", "fits", "step_seconds")
    return {k: report[k] for k in keep}


def optim_offload(args) -> tuple[list[str], dict]:
    """The optimizer's device bytes moved off per rank by optim.offload=cpu (module docstring)."""
    lines, per_layout = _per_layout(args, _optimizer_rank)
    runs = [{"world": world, "layout": name, "ranks": ranks} for world, name, _, ranks in per_layout]
    gib, kib = 2 ** 30, 1024
    lines += ["optim.offload: optimizer bytes per rank after one step (gloo, KiB)",
              f"{'world':>5} {'layout':<13} {'rank':>4} {'device, none':>12} {'device, cpu':>11} {'host, cpu':>9}"]
    for run in runs:
        for rank, r in enumerate(run["ranks"]):
            lines.append(f"{run['world']:>5} {run['layout']:<13} {rank:>4} {r['none_device_bytes'] / kib:>12.1f} "
                         f"{r['cpu_device_bytes'] / kib:>11.1f} {r['host_bytes'] / kib:>9.1f}")
    rehearsed = []
    lines += ["optim.offload rehearsed at full size, rank 0 (GiB): optimizer state on the device and the peak",
              f"{'model @ GPUs':<18} {'optim none':>10} {'optim cpu':>9} {'peak none':>9} {'peak cpu':>8} "
              f"{'host cpu':>8} {'fits 80 GB':>10}  peak at (cpu)"]
    for name, world, config in OPTIM_OFFLOAD_REHEARSALS:
        none, cpu = (_rehearse_offload(config, world, o) for o in ("none", "cpu"))
        moved = none["peak_split"]["optimizer state"] - cpu["peak_split"]["optimizer state"]
        rehearsed.append({"model": name, "world": world, "config": config, "none": none, "cpu": cpu,
                          "optimizer_device_bytes_offloaded": moved})
        lines.append(f"{name + '@' + str(world):<18} {none['peak_split']['optimizer state'] / gib:>10.1f} "
                     f"{cpu['peak_split']['optimizer state'] / gib:>9.1f} {none['peak_bytes'] / gib:>9.1f} "
                     f"{cpu['peak_bytes'] / gib:>8.1f} {cpu['host_bytes'] / gib:>8.1f} "
                     f"{'yes' if cpu['fits'] else 'no':>10}  {cpu['peak_moment']}")
    return lines, {"optimizer_device_bytes_offloaded": rehearsed[0]["optimizer_device_bytes_offloaded"],
                   "optim_offload": {"config": args.config, "runs": runs, "rehearsals": rehearsed}}


# ---------------------------------------------------------------------- driver

SECTIONS = {"weight_sync": weight_sync}
SECTIONS["bf16_params"] = bf16_params
SECTIONS["offload"] = offload
SECTIONS["optim_offload"] = optim_offload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[4, 8], help="gloo world sizes")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_cpu.yaml"))
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the export's dtype")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    result = {"world": args.world, "config": args.config}
    for name in args.sections:
        lines, keys = SECTIONS[name](args)
        print("\n".join(lines), flush=True)
        result.update(keys)
    write_json(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
