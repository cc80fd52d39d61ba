"""One rank of an N-rank job in this process: torch's `fake` process group (every collective
returns at once, values untouched), the rank's groups, and its part of the model on `meta`.

    with fake_world(8, rank=3):
        dims, runtime = build_rank(cfg, 8, 3)
        failure = first_failure(lambda: run_micro_batch(runtime, meta_batch([1000, 3000, 96])))

Nothing here changes the program: a failure is reported with the program's file:line and op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from data_packing.batch import PackedBatch

_PACKAGES = ("data_packing", "cp_attention", "longctx_moe", "rl_hooks")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """The default process group as rank `rank` of `world_size` fake ranks, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from longctx_moe.parallel.dims import destroy_process_groups
    from longctx_moe.rehearsal.host_memory import host_memory

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists in this process; "
                           "rehearse in a process of its own")
    # fake on meta too: a device tensor's collective (batch_isend_irecv's p2p above all) looks
    # its backend up by the tensor's device type, which is meta here
    dist.init_process_group("meta:fake,cpu:fake,cuda:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with host_memory():  # the node's host memory, which this machine does not have
            yield
    finally:
        destroy_process_groups(collect=False)  # fake groups hold no threads or sockets


# What a rehearsed rank imports, loaded once by the server its processes fork from: a spawned
# process imported them again for each rank (~3 CPU-s, most of a small rank's rehearsal).
_PRELOAD = ["torch", "torch._dynamo", "longctx_moe.trainer", "longctx_moe.rehearsal.step"]


def in_own_process(target: Callable, *args) -> tuple[str, object]:
    """`target(conn, *args)` in a process of its own (torch allows one default process group per
    process), which sends one (kind, payload) reply into `conn`; that reply, or ("crash", why)
    when the process died without one. The process is forked from multiprocessing's fork server,
    which holds no process group, threads or device state of this one's (spawned where there is
    no fork server)."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first call)
    else:
        ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    child.close()
    try:
        reply = parent.recv()
    except EOFError:
        reply = ("crash", f"the process died (exit code {proc.exitcode})")
    proc.join()
    return reply


def _param_dtype(cfg, param_dtype: torch.dtype | None) -> torch.dtype:
    """`param_dtype`, or the one `cfg` holds its parameters in (train.param_dtype)."""
    from longctx_moe.precision import PARAM_DTYPES

    return param_dtype or PARAM_DTYPES[cfg.train.param_dtype]


def gpu_compute(cfg, param_dtype: torch.dtype | None = None):
    """The ComputeDtype `cfg` resolves to on a CUDA GPU with native bf16 (Hopper and later, the
    rehearsed one): train.autocast_dtype auto computes in bf16 there (meta has no rule of its own).
    `param_dtype`: default the config's."""
    from longctx_moe.precision import ComputeDtype

    param_dtype = _param_dtype(cfg, param_dtype)
    setting = cfg.train.autocast_dtype
    if setting == "none" or param_dtype == torch.float64:
        return ComputeDtype(None, param_dtype, setting, "no autocast")
    dtype = torch.float16 if setting == "fp16" else torch.bfloat16
    return ComputeDtype(dtype, param_dtype, setting, "the rehearsed GPU computes bf16 natively")


def cuda_ops(cfg, param_dtype: torch.dtype | None = None, rl: bool = False):
    """The Ops `cfg` resolves to on the rehearsed CUDA GPU (gpu_compute's dtype); `rl`: an RL
    policy's (execution.resolve). `param_dtype`: default the config's."""
    from longctx_moe.execution import Target, resolve

    param_dtype = _param_dtype(cfg, param_dtype)
    compute = gpu_compute(cfg, param_dtype).dtype
    target = Target("cuda", compute, param_dtype, cfg.train.compile, cfg.parallel.tp)
    return resolve(cfg.execution, target, cfg.train.recompute, rl)


def build_rank(cfg, world_size: int, rank: int, dtype: torch.dtype | None = None, routing: str = "balanced",
               ops=None):
    """(dims, runtime): the layout of `cfg` (longctx_moe.config.Config) for `rank`, and the
    model built on meta in `dtype` (default the config's train.param_dtype) with `ops` (default:
    a CUDA device's), parallelized as `longctx-moe train` does it."""
    from longctx_moe.build import _parallelize, check_layout
    from longctx_moe.model import Transformer
    from longctx_moe.precision import cast_params

    dims = check_layout(cfg, world_size)
    dims.build_groups(rank)
    dtype = _param_dtype(cfg, dtype)
    with torch.device("meta"):
        model = cast_params(Transformer(cfg.model, ops or cuda_ops(cfg, dtype), balance=cfg.balance), dtype)
    from longctx_moe.rehearsal.routing import AssumedRouting

    return dims, _parallelize(cfg, model, dims, AssumedRouting(routing))


def host_batch(lengths: list[int], multiple: int = 1) -> PackedBatch:
    """A packed micro-batch of documents of `lengths` on the host (token values 0): the
    metadata the loader would give, each slot padded to `multiple`."""
    from data_packing.batch import pack_documents

    docs = [torch.zeros(n, dtype=torch.long) for n in lengths]
    return pack_documents(docs, [d.clone() for d in docs], multiple)


def meta_batch(batch: PackedBatch, keep_host: bool = False) -> PackedBatch:
    """`batch` on the meta device (as the trainer's `mb.to(device)`); `keep_host`: the document
    boundaries stay host tensors (the seam the findings propose)."""
    moved = batch.to("meta")
    if keep_host:
        moved = dataclasses.replace(moved, cu_seqlens=batch.cu_seqlens,
                                    cu_seqlens_padded=batch.cu_seqlens_padded)
    return moved


def run_micro_batch(runtime, batch: PackedBatch) -> torch.Tensor:
    """Forward and backward of one micro-batch through the runtime (no optimizer step)."""
    shard = runtime.shard(batch, None, num_targets=batch.num_tokens)
    out = runtime.forward(shard)
    loss = out.ce_sum + out.aux_loss + out.z_loss
    loss.backward()
    return loss


@dataclasses.dataclass(frozen=True)
class Failure:
    where: str  # file:line (function) of the program's innermost frame
    op: str  # that line's source
    error: str  # the exception's type and first line

    def __str__(self) -> str:
        return f"{self.where}: {self.op} -> {self.error}"


def first_failure(step: Callable[[], object]) -> Failure | None:
    """None when `step()` runs through; else where in the program it failed."""
    try:
        step()
    except Exception as e:  # any failure of the program is the finding
        return _failure_of(e)
    return None


def _failure_of(e: BaseException) -> Failure:
    ours = [f for f in traceback.extract_tb(e.__traceback__)
            if any(f"/{p}/" in f.filename for p in _PACKAGES) and "/rehearsal/" not in f.filename]
    frame = ours[-1] if ours else traceback.extract_tb(e.__traceback__)[-1]
    root = next((p for p in Path(frame.filename).parents if (p / "pyproject.toml").is_file()), None)
    name = str(Path(frame.filename).relative_to(root)) if root else frame.filename
    first = (str(e).splitlines() or [""])[0][:200]
    return Failure(f"{name}:{frame.lineno} ({frame.name})", (frame.line or "").strip(),
                   f"{type(e).__name__}: {first}")
