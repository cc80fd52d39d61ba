"""Bucketed gradient reduction launched from backward hooks (parallel.grad_bucket_mb) on 4 gloo
ranks, against the one-buffer reduction after the backward.

The real Transformer (shared expert, dense first layer) in float64, two micro-batches of gradient
accumulation; only the last backward launches buckets. Bucketing changes how the all-reduce
chunks each buffer, i.e. the order in which the 4 ranks' values are summed, so the comparison
with one buffer is to 1e-10 (float64 sums of 4 terms of size ~1 agree to ~1e-15). The same
buckets launched after the backward instead of from the hooks are bitwise equal.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from longctx_moe.model import build_model
from longctx_moe.model.config import BalanceConfig
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims, destroy_process_groups
from longctx_moe.parallel.parallelize import parallelize
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config

TOL = 1e-10
DOCS = [[5, 9, 1, 13], [1, 7, 3], [12, 2], [2, 2, 6], [17, 4], [3, 3, 3, 3]]
# EP4 (experts not reduced: edp = 1), EP2 x EDP2, TP2 (q/k-norm reduce_axis = world), CP2.
LAYOUTS = [dict(ep=4), dict(ep=2), dict(tp=2, ep=2), dict(cp=2, ep=2)]
BUCKET_MB = 0.004  # ~1,000 float64 values: the tiny model spreads over many buckets


def _model(seed):
    torch.manual_seed(seed)
    cfg = tiny_config(num_experts=4, top_k=2, first_k_dense=1, shared_expert_hidden_size=16)
    balance = BalanceConfig(aux_loss_type="seq", aux_loss_coeff=0.1, z_loss_coeff=0.01)
    return build_model(cfg, balance=balance).double()


def _grads(rank, world, kw, bucket_mb, arm, seed):
    """{name: grad} after two micro-batches; checks the buckets launch only in the armed one."""
    cfg = ParallelConfig(grad_bucket_mb=bucket_mb, **kw)
    dims = ParallelDims.from_config(cfg, world, tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(_model(seed), dims, cfg)
    buckets = runtime.buckets
    assert (buckets is None) == (bucket_mb == 0)
    gen = torch.Generator().manual_seed(seed + 100 * dims.rank_in("dp"))
    pad = 2 * dims.cp * dims.tp
    for i in range(2):
        batch = packed_batch(DOCS[(seed + i) % len(DOCS)], 64, pad_multiple=pad, generator=gen)
        out = runtime.forward(runtime.shard(batch))
        last = i == 1
        if arm and last:
            runtime.start_gradient_reduction()
        (out.ce_sum / 64 + out.aux_loss + out.z_loss).backward()
        if buckets is not None:  # the hooks launched buckets in the armed backward, and only then
            launched = sum(b.work is not None for b in buckets.buckets)
            assert (launched > 0) == (arm and last), (kw, i, launched)
            assert launched == buckets.next
    if buckets is not None:
        assert len(buckets.buckets) > 3, len(buckets.buckets)
    runtime.reduce_gradients()
    return {n: p.grad.clone() for n, p in runtime.model.named_parameters()}


def _check(rank, world):
    for seed, kw in enumerate(LAYOUTS):
        one_buffer = _grads(rank, world, kw, 0.0, False, seed)
        hooked = _grads(rank, world, kw, BUCKET_MB, True, seed)
        after = _grads(rank, world, kw, BUCKET_MB, False, seed)
        for name, want in one_buffer.items():
            err = (hooked[name] - want).abs().max().item()
            assert err < TOL, (kw, name, err)
            assert torch.equal(hooked[name], after[name]), (kw, name)
    _check_misuse(rank, world)
    _check_released(rank, world)
    return True


def _gloo_threads() -> list[str]:
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return [n for n in names if "gloo" in n]


def _check_released(rank, world):
    """A dropped runtime is freed at once (its parameters' hooks hold the buckets weakly), and
    destroy_process_groups then leaves no gloo thread: nothing of the process groups is left for
    the interpreter's exit to destroy after the peer ranks have gone."""
    cfg = ParallelConfig(ep=2, grad_bucket_mb=BUCKET_MB)
    dims = ParallelDims.from_config(cfg, world, tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(_model(0), dims, cfg)
    out = runtime.forward(runtime.shard(packed_batch(DOCS[0], 64)))
    (out.ce_sum / 64 + out.aux_loss + out.z_loss).backward()
    runtime.reduce_gradients()
    model = weakref.ref(runtime.model)
    del runtime, out, dims
    gc.collect()
    assert model() is None
    assert _gloo_threads()
    destroy_process_groups()
    assert not _gloo_threads()


def _check_misuse(rank, world):
    """A second backward after start_gradient_reduction() would change gradients already on the
    wire: refused with the fix, the same way on every rank (then drained)."""
    cfg = ParallelConfig(ep=4, grad_bucket_mb=BUCKET_MB)
    dims = ParallelDims.from_config(cfg, world, tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(_model(0), dims, cfg)
    batch = packed_batch(DOCS[0], 64, generator=torch.Generator().manual_seed(rank))
    runtime.start_gradient_reduction()
    for i in range(2):
        out = runtime.forward(runtime.shard(batch))
        loss = out.ce_sum / 64 + out.aux_loss + out.z_loss
        if i == 0:
            loss.backward()
            continue
        with pytest.raises(RuntimeError, match="only before the last backward"):
            loss.backward()
    runtime.reduce_gradients()  # every rank launched the same buckets: nothing is left hanging


@pytest.mark.slow
def test_bucketed_reduction_from_hooks_matches_one_buffer_float64():
    assert run_distributed(_check, world_size=4, timeout=600) == [True] * 4


def test_negative_bucket_size_is_refused():
    with pytest.raises(ValueError, match=r"parallel.grad_bucket_mb=-1 must be >= 0"):
        ParallelConfig(grad_bucket_mb=-1).validate()
