"""Pushing the policy's weights to a rollout engine: the HF-named buckets of
longctx_moe.hf.weights, streamed to a sink (an engine's weight loader, a Ray object, a file).

Every rank of the trainer takes part (the buckets are assembled with collectives over tp, ep and
etp) and every rank yields every bucket, so an engine colocated with any rank can load from it; a
sink that feeds one engine should push from one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longctx_moe.hf.weights import Bucket, export_weights


def push_weights(model, dims, sink: Callable[[Bucket], None], bucket_bytes: int,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Stream every bucket to `sink`; returns {buckets, tensors, bytes}."""
    stats = {"buckets": 0, "tensors": 0, "bytes": 0}
    for bucket in export_weights(model, dims, bucket_bytes, dtype):
        sink(bucket)
        stats["buckets"] += 1
        stats["tensors"] += len(bucket)
        stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
    return stats
