"""Faults planted inside a rehearsed step, each one a GPU job would fail on and torch's fake
process group lets through; the rehearsal must refuse each in one line naming the rank and the op.

    line = rehearse_planted(cfg, world=8, ranks=[0, 3], plant="host tensor to a collective")

- "host tensor to a collective": the gradients' all-reduce is handed a tensor made on the host
  (NCCL takes device memory only);
- "host tensor in device work": a norm adds a host tensor to its device output (the CUDA
  dispatcher refuses mixed devices);
- "dtype mismatch across a collective": on one rank only, the expert all-to-all moves float32
  where its peers move bf16 (each rank's call is valid alone; NCCL would read garbage or hang).
  Caught by comparing the rehearsed ranks' collective sequences (collectives.check_agreement).

The plant patches the program from outside, for the block, in the rank's own process: nothing in
the program knows. Each rank is rehearsed in a process of its own (one default process group per
process), as `longctx-moe rehearse` does it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _host_tensor_to_collective() -> Iterator[None]:
    real = dist.all_reduce

    def planted(tensor, *args, **kwargs):
        if tensor.is_meta and tensor.is_floating_point():
            tensor = torch.zeros(tensor.shape, dtype=tensor.dtype)
        return real(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", planted):
        yield


@contextlib.contextmanager
def _host_tensor_in_device_work() -> Iterator[None]:
    from longctx_moe.model.layers import RMSNorm

    real = RMSNorm.forward

    def planted(self, x, *args, **kwargs):
        out = real(self, x, *args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        first = first + torch.zeros(first.shape[-1], dtype=first.dtype)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    with mock.patch.object(RMSNorm, "forward", planted):
        yield


@contextlib.contextmanager
def _other_dtype_in_all_to_all() -> Iterator[None]:
    real = dist.all_to_all_single

    def planted(output, input, *args, **kwargs):
        if input.is_floating_point() and input.dtype != torch.float32:
            output, input = output.float(), input.float()
        return real(output, input, *args, **kwargs)

    with mock.patch.object(dist, "all_to_all_single", planted):
        yield


# plant -> (its context manager, whether it is planted on the last rehearsed rank only)
PLANTS = {
    "host tensor to a collective": (_host_tensor_to_collective, False),
    "host tensor in device work": (_host_tensor_in_device_work, False),
    "dtype mismatch across a collective": (_other_dtype_in_all_to_all, True),
}


def _rank_process(conn, cfg, world: int, rank: int, gpu, lengths: list[int], plant: str | None) -> None:
    from longctx_moe.rehearsal.collectives import RehearsalFault
    from longctx_moe.rehearsal.step import rehearse_rank

    try:
        with PLANTS[plant][0]() if plant else contextlib.nullcontext():
            report = rehearse_rank(cfg, world, rank, gpu, lengths)
        conn.send(("ok", report.calls))
    except RehearsalFault as e:
        conn.send(("fault", str(e)))
    except Exception as e:  # noqa: BLE001 - anything else is a rehearsal that did not catch it
        conn.send(("crash", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _rehearse_in_process(cfg, world: int, rank: int, gpu, lengths: list[int], plant: str | None):
    from longctx_moe.rehearsal.fake_world import in_own_process

    return in_own_process(_rank_process, cfg, world, rank, gpu, lengths, plant)


def rehearse_planted(cfg, world: int, ranks: list[int], plant: str, gpu, lengths: list[int]) -> str | None:
    """The one-line fault the rehearsal reports for `plant` on `ranks` of `cfg` (None: not
    caught). A crash that is not a RehearsalFault raises: the rehearsal did not name the fault."""
    from longctx_moe.rehearsal.collectives import RehearsalFault, check_agreement

    _, last_only = PLANTS[plant]
    calls = {}
    for rank in ranks:
        kind, payload = _rehearse_in_process(cfg, world, rank, gpu, lengths,
                                             plant if not last_only or rank == ranks[-1] else None)
        if kind == "fault":
            return payload
        if kind == "crash":
            raise RuntimeError(f"rank {rank} with {plant!r} planted failed outside the rehearsal's checks: {payload}")
        calls[rank] = payload
    try:
        check_agreement(calls)
    except RehearsalFault as e:
        return str(e)
    return None
