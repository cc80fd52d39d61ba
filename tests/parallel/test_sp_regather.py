"""Sequence parallelism keeps each TP region's gathered input as own rows until the backward.

On 2 gloo ranks (TP2 with sequence parallelism, the real Transformer with a dense first layer and
a shared expert, fp32): after the forward, no all-gathered region input (attention, dense MLP,
shared expert) is alive any more, while without the re-gather (its saved-tensor hook made a
pass-through) every one of them is, held by the linears that read it. Loss and every gradient are
bitwise equal either way: the backward gathers the same rows again. Under full recompute nothing is
re-gathered (the block keeps nothing of its forward), and the results are again bitwise equal.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from longctx_moe.execution import default_ops
from longctx_moe.model import build_model
from longctx_moe.parallel import sequence_parallel as sp
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config

DOCS = [5, 9, 1, 13, 4]


def _run(rank, world, recompute="none"):
    """(loss, grads, weak references to the region inputs gathered in the forward)."""
    torch.manual_seed(0)
    cfg = tiny_config(num_experts=4, top_k=2, first_k_dense=1, shared_expert_hidden_size=16)
    pcfg = ParallelConfig(tp=2, sequence_parallel=True)
    dims = ParallelDims.from_config(pcfg, world, cfg)
    dims.build_groups(rank)
    runtime = parallelize(build_model(cfg, default_ops().replace(recompute=recompute)), dims, pcfg)
    batch = packed_batch(DOCS, 64, pad_multiple=2, generator=torch.Generator().manual_seed(1))
    gathered, gather = [], sp.gather_tokens

    def recording(x, group, reduce_grad):
        out = gather(x, group, reduce_grad)
        if reduce_grad:  # a TP region's entry (the final norm's gather feeds the LM head)
            gathered.append(weakref.ref(out))
        return out

    sp.gather_tokens = recording
    try:
        out = runtime.forward(runtime.shard(batch))
    finally:
        sp.gather_tokens = gather
    gc.collect()
    alive = [r() is not None for r in gathered]
    (out.ce_sum / 64 + out.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in runtime.model.named_parameters()}
    return out.ce_sum.detach(), grads, alive


def _check(rank, world):
    loss, grads, alive = _run(rank, world)
    assert len(alive) == 4, alive  # 2 attentions, the dense MLP (layer 0), the shared expert
    assert not any(alive), alive
    pack = sp._Regather.pack
    sp._Regather.pack = lambda self, t: t  # keep the gathered tensors: the old behaviour
    try:
        loss_kept, grads_kept, alive_kept = _run(rank, world)
    finally:
        sp._Regather.pack = pack
    assert all(alive_kept), alive_kept  # the check above can fail
    assert torch.equal(loss, loss_kept)
    for name, g in grads.items():
        assert torch.equal(g, grads_kept[name]), name
    loss_full, grads_full, _ = _run(rank, world, recompute="full")
    assert torch.equal(loss, loss_full)
    for name, g in grads.items():
        assert torch.equal(g, grads_full[name]), name
    return True


@pytest.mark.slow
def test_sequence_parallel_regathers_region_inputs_in_the_backward():
    assert run_distributed(_check, world_size=2, timeout=300) == [True] * 2
