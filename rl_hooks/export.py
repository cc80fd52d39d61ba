"""Pushing the policy's weights to a rollout engine: the HF-named buckets of
longctx_moe.hf.weights, streamed to a sink (an engine's weight loader, a Ray object, a file).

Every rank of the trainer takes part (the buckets are assembled with collectives over tp, ep and
etp) and every rank yields every bucket, so an engine colocated with any rank can load from it; a
sink that feeds one engine should push from one rank.

`export_weight_shards` is the per-shard export (longctx_moe.hf.shards): each rank yields only its
own pieces of the HF tensors, each element once over all ranks, about model bytes / world per
rank, with no communication, so the engines' ranks take their pieces directly.

An export may be left early (a driver that stops reading): after each bucket the ranks vote
(one all-reduce of a flag) on going on, so a rank whose iterator is closed, or dropped and then
settled at its policy's next call (`ExportGate`), stops its peers at the same bucket; their next
read raises a one-line ExportAbandoned and every rank can make its next call. Closing releases
the gathered tensors the suspended export holds.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from longctx_moe.hf.shards import ShardRecord, export_shards
from longctx_moe.hf.weights import Bucket
from longctx_moe.hf.weights import export_weights as weight_buckets
from longctx_moe.parallel.comm import host_collective


def export_weights(model, dims, bucket_bytes: int, dtype: torch.dtype = torch.bfloat16,
                   gate: ExportGate | None = None) -> WeightExport:
    """Buckets of (HF name, tensor) of at most `bucket_bytes` bytes each (collective). `gate`:
    the policy's, which settles an export left open before the policy's next collective call."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    gate = gate or ExportGate()
    gate.settle()
    return gate.track(WeightExport(weight_buckets(model, dims, bucket_bytes, dtype), gate))


def export_weight_shards(model, dims, dtype: torch.dtype = torch.bfloat16,
                         gate: ExportGate | None = None) -> Iterator[ShardRecord]:
    """This rank's ShardRecords (longctx_moe.hf.shards), in export order. No collective: a rank
    may stop reading whenever it likes. `gate`: the policy's, whose open whole-tensor export is
    settled first (that is collective, like the policy's other calls)."""
    if gate is not None:
        gate.settle()
    return export_shards(model, dims, dtype)


class ExportAbandoned(RuntimeError):
    """Another rank left the export early: the message is one line."""


@host_collective  # a host flag by design: on a GPU run it goes to gloo beside NCCL (process.py)
def _all_go_on(go: bool) -> bool:
    """Collective over every rank: whether all of them go on."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return go
    flag = torch.tensor([int(go)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class WeightExport:
    """The buckets of one export, in order, with a vote after each (see the module docstring).
    `stop` (set from any thread, e.g. a Ray driver's request) ends it at the next vote."""

    def __init__(self, buckets: Iterator[Bucket], gate: ExportGate):
        self._buckets, self._gate, self._sent = buckets, gate, 0
        self._open = False  # a bucket was handed out and its vote is still to come
        self.stop = threading.Event()

    def __iter__(self) -> WeightExport:
        return self

    def __next__(self) -> Bucket:
        if self._buckets is None:
            raise StopIteration
        if self._open and not _all_go_on(not self.stop.is_set()):
            self._release()
            if self.stop.is_set():
                raise StopIteration
            raise ExportAbandoned(f"export_weights stopped after bucket {self._sent}: another rank left the "
                                  "export early; call export_weights again on every rank for all buckets")
        try:
            bucket = next(self._buckets)
        except StopIteration:
            self._release()
            raise
        self._open, self._sent = True, self._sent + 1
        return bucket

    def send(self, value: None) -> Bucket:
        """As a generator's: lets a generator delegate to this export with `yield from`."""
        return next(self)

    def close(self) -> None:
        """Leave the export now (collective with the peers' next read): stops them at this bucket."""
        if self._open:
            _all_go_on(False)
        self._release()

    def _release(self) -> None:
        self._gate.sent = self._sent
        if self._buckets is not None:
            self._buckets.close()  # drops the gathered tensors the suspended generator holds
        self._buckets, self._open = None, False

    def __del__(self) -> None:
        # Dropped mid-export: release now, vote at the policy's next call (a deterministic point,
        # unlike garbage collection).
        if self._open:
            self._gate.owed = True
        self._release()


class ExportGate:
    """A policy's latest export: `settle()`, called before each of the policy's collective calls,
    closes it if it is still open and casts the vote a dropped one owes."""

    def __init__(self):
        self._latest: Callable[[], WeightExport | None] = lambda: None
        self.owed = False
        self.sent = 0  # buckets the last ended export handed out

    def track(self, export: WeightExport) -> WeightExport:
        self._latest = weakref.ref(export)
        return export

    def settle(self) -> None:
        export = self._latest()
        if export is not None:
            export.close()
        if self.owed:
            self.owed = False
            _all_go_on(False)

    def stop(self) -> None:
        """End the open export at its next vote (thread-safe: a Ray control call)."""
        export = self._latest()
        if export is not None:
            export.stop.set()


def push_weights(model, dims, sink: Callable[[Bucket], None], bucket_bytes: int,
                 dtype: torch.dtype = torch.bfloat16, gate: ExportGate | None = None) -> dict[str, float]:
    """Stream every bucket to `sink`; returns {buckets, tensors, bytes}."""
    stats = {"buckets": 0, "tensors": 0, "bytes": 0}
    for bucket in export_weights(model, dims, bucket_bytes, dtype, gate):
        sink(bucket)
        stats["buckets"] += 1
        stats["tensors"] += len(bucket)
        stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
    return stats
