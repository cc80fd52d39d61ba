"""How true a rehearsal's memory is: the same ranks run the same optimizer step twice, once for
real (real tensors on this CPU, one gloo process per rank) and once rehearsed (meta tensors, the
fake group, step.rehearse_rank), each measured by MemTracker the same way: the categories of
step.py at the peak of a step after a warm-up step. Per rank: real bytes, rehearsed bytes and
their ratio, overall and per category.

    truth = memory_truth(cfg, world=4, lengths=[300, 700, 24])
    truth.worst_ratio()  # real / rehearsed furthest from 1 over the ranks

Both runs run the same thing: the ops this CPU resolves, in its compute dtype, except that an op
resolved to a C++ kernel (CPU tensors only, which meta cannot run) runs its torch path in both,
set through the config's execution section (`Truth.torch_instead_of_cpp` names them). The real
run's routing is the router's on random tokens (about balanced at initialisation); the
rehearsal assumes balanced routing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from unittest import mock

import torch

TOTAL = "total"


@dataclasses.dataclass
class RankTruth:
    rank: int
    roles: dict  # axis -> this rank's coordinate
    real: dict  # category -> bytes at the real step's peak; TOTAL: the peak
    rehearsed: dict  # the same of the rehearsal

    def ratios(self) -> dict:
        """category -> real / rehearsed (None where the rehearsal holds none of it)."""
        return {k: (self.real[k] / v if v else None) for k, v in self.rehearsed.items()}

    @property
    def ratio(self) -> float:
        return self.real[TOTAL] / self.rehearsed[TOTAL]


@dataclasses.dataclass
class Truth:
    world: int
    layout: dict  # the parallel degrees of the run
    ops: dict  # the resolved Ops both runs ran (Ops.as_dict)
    compute_dtype: str
    torch_instead_of_cpp: list[str]  # execution keys set to torch: their C++ kernels cannot run on meta
    ranks: list[RankTruth]

    def worst_ratio(self) -> float:
        """The ranks' real / rehearsed peak furthest from 1 (as a factor either way)."""
        return max((r.ratio for r in self.ranks), key=lambda x: abs(math.log(x)))

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "worst_ratio": self.worst_ratio(),
                "ratios": [{"rank": r.rank, **r.ratios()} for r in self.ranks]}


def memory_truth(cfg, world: int, lengths: list[int], launch: Callable | None = None,
                 timeout: float = 600.0) -> Truth:
    """Run and rehearse every rank of `cfg` (a longctx_moe.config.Config) on `world` ranks, each
    one optimizer step of a micro-batch of documents of `lengths` (the same lengths on every
    rank; tokens differ per data-parallel rank); compare their peaks. `launch(fn, world, args,
    timeout)`: how the gloo ranks start (default: spawned processes, `launch_gloo`)."""
    cfg, swapped = meta_runnable(cfg)
    results = (launch or launch_gloo)(_measure_rank, world, args=(cfg, list(lengths)), timeout=timeout)
    ranks = [RankTruth(r["rank"], r["roles"], r["real"], r["rehearsed"]) for r in results]
    first = results[0]
    p = cfg.parallel
    layout = {"tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "sequence_parallel": p.sequence_parallel,
              "cp_backend": p.cp_backend}
    return Truth(world, layout, first["ops"], first["compute_dtype"], swapped, ranks)


def meta_runnable(cfg):
    """(cfg with each op that resolves to a C++ kernel on this CPU set to its torch path, the
    execution keys so set): the C++ kernels take CPU tensors only, and the rehearsal must run what
    the real run runs."""
    from longctx_moe.build import resolve_ops

    ops = resolve_ops(cfg, torch.device("cpu"))
    swapped = [f"execution.{op}" for op, path in ops.as_dict().items()
               if path == "cpp" and hasattr(cfg.execution, op)]
    if not swapped:
        return cfg, []
    execution = dataclasses.replace(cfg.execution, **{k.split(".", 1)[1]: "torch" for k in swapped})
    return dataclasses.replace(cfg, execution=execution), swapped


# The program's choices made from a tensor's device type rather than from the resolved Ops: on
# meta they take the GPU's branch, which a rehearsal of a GPU wants; standing for this CPU, meta
# must take the CPU's. (module, function name) of each.
CPU_RULES = (("longctx_moe.model.losses", "_block_rows"),)  # the CE's cache-sized row blocks


@contextlib.contextmanager
def cpu_rules_on_meta() -> Iterator[None]:
    """For the block: the program's device-type rules (CPU_RULES) answer for a meta tensor or
    device as for a CPU one."""
    import importlib

    with contextlib.ExitStack() as stack:
        for module, name in CPU_RULES:
            mod = importlib.import_module(module)
            stack.enter_context(mock.patch.object(mod, name, _as_cpu(getattr(mod, name))))
        yield


def _as_cpu(rule: Callable) -> Callable:
    def cpu_stand_in(x):
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if isinstance(x, torch.Tensor) and x.is_meta:  # the shape and dtype, on the CPU, one element stored
            return torch.empty((1,) * x.dim(), dtype=x.dtype).expand(x.shape)
        return x

    @functools.wraps(rule)
    def on_cpu(*args, **kwargs):
        args, kwargs = torch.utils._pytree.tree_map(cpu_stand_in, (args, kwargs))
        return rule(*args, **kwargs)
    return on_cpu


# ---------------------------------------------------------------- one rank, in its gloo process


def _measure_rank(rank: int, world: int, cfg, lengths: list[int]) -> dict:
    """In rank `rank`'s process, its gloo group up: the real step measured, then (the group
    destroyed) the same rank rehearsed with the real run's ops and compute dtype."""
    from longctx_moe.parallel.dims import destroy_process_groups
    from longctx_moe.rehearsal.gpus import GPUS
    from longctx_moe.rehearsal.step import rehearse_rank

    real, roles, ops, compute = _real_step(cfg, world, rank, lengths)
    destroy_process_groups()
    # the GPU only sets the report's fit and modeled time, which this comparison does not read
    with cpu_rules_on_meta():
        report = rehearse_rank(cfg, world, rank, GPUS["h100"], lengths, ops=ops, compute=compute)
    return {"rank": rank, "roles": roles, "real": real,
            "rehearsed": {**report.peak_split, TOTAL: report.peak_bytes},
            "ops": ops.as_dict(), "compute_dtype": compute.name}


def _real_step(cfg, world: int, rank: int, lengths: list[int]):
    """(peak by category, roles, Ops, ComputeDtype) of a real optimizer step on this CPU after a
    warm-up step, measured as step.rehearse_rank measures the rehearsal."""
    from data_packing.batch import pack_documents, pad_multiple
    from longctx_moe.build import build_runtime, check_layout
    from longctx_moe.rehearsal.memtrack import FastMemTracker, on_device
    from longctx_moe.rehearsal.step import _roles, _split
    from longctx_moe.trainer import Trainer

    dims = check_layout(cfg, world)
    dims.build_groups(rank)
    device = torch.device("cpu")
    runtime = build_runtime(cfg, dims, device)
    trainer = Trainer(cfg, runtime, device)
    # TP and CP peers hold the same micro-batch: the tokens are drawn per data-parallel rank
    g = torch.Generator().manual_seed(1000 + dims.rank_in("dp"))
    docs = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g) for n in lengths]
    p = cfg.parallel
    batch = pack_documents(docs, [d.clone() for d in docs], pad_multiple(p.cp, p.tp, p.sequence_parallel))
    trainer.train_step([batch])  # the first step creates the optimizer's state
    tracker = FastMemTracker()
    tracker.track_state(runtime.model, trainer.optimizer)
    with tracker:
        trainer.train_step([batch])
    snap = tracker.get_tracker_snapshot("peak")
    cpu = on_device(snap, "cpu")
    return {**_split(cpu), TOTAL: int(cpu.get("Total", 0))}, _roles(dims), runtime.model.ops, trainer.compute


# ---------------------------------------------------------------- gloo ranks


def launch_gloo(fn: Callable, world: int, args: tuple = (), timeout: float = 600.0) -> list:
    """`fn(rank, world, *args)` in `world` spawned processes, each with its gloo default group up
    and one intra-op thread; the results by rank, or RuntimeError with a failed rank's traceback
    (or naming the ranks not done within `timeout` seconds)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(fn, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    missing = dead or sorted(set(range(world)) - set(out))
                    raise RuntimeError(f"memory truth: ranks {missing} died or did not finish within "
                                       f"{timeout:.0f} s; rerun with a longer timeout or fewer tokens") from None
                continue
            if not ok:
                raise RuntimeError(f"memory truth: rank {rank} failed:\n{payload}")
            out[rank] = payload
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def _gloo_rank(fn, rank: int, world: int, port: int, args: tuple, results) -> None:
    import torch.distributed as dist

    from longctx_moe.parallel.dims import destroy_process_groups
    from longctx_moe.process import import_before_init

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # N ranks share this machine's cores
    try:
        import_before_init()
        dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - the traceback goes to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_process_groups()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
