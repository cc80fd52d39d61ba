"""parallelize (EP + DP) on the real Transformer: 4 gloo ranks against one process, float64.

Each rank runs its own packed micro-batch; the reference runs all four with the unsharded model.
After the reductions the trainer does (dense over dp_cp, experts over edp, summed: the loss is a
sum over ranks), every gradient equals the reference within 1e-10 (summation order only).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.model import build_model
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.grad_reduce import reduce_gradients, split_params
from longctx_moe.parallel.parallelize import parallelize
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config

TOL = 1e-10
DOCS = [[5, 9], [1, 7, 3], [12], [2, 2, 6]]  # per rank; a length-1 document included
LAYOUTS = [dict(ep=2), dict(ep=4, dispatcher="allgather")]


def _loss(model, batch):
    out = model(batch)
    return out.ce_sum + out.aux_loss + out.z_loss, out.expert_counts


def _model(seed):
    torch.manual_seed(seed)
    return build_model(tiny_config(num_experts=4, top_k=2)).double()


def _check_layout(rank, world, kw, seed):
    dims = ParallelDims.from_config(ParallelConfig(**kw), world, tiny_config())
    dims.build_groups(rank)
    gen = torch.Generator().manual_seed(seed)
    batches = [packed_batch(d, 64, generator=gen) for d in DOCS]
    ref = _model(seed)
    ref_loss = sum(_loss(ref, b)[0] for b in batches)
    ref_loss.backward()
    model = parallelize(_model(seed), dims)
    loss, counts = _loss(model, batches[rank])
    loss.backward()
    dense, expert = split_params(model)
    assert all(getattr(p, "reduce_axis", "dp_cp") == "edp" for p in expert) and expert
    reduce_gradients(dense, expert, dims)
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert abs(total.item() - ref_loss.item()) < TOL, kw
    e0 = dims.rank_in("ep") * 4 // dims.ep
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if p.shape != want.shape:  # an expert weight: this rank's slice of dim 0
            want = want[e0:e0 + p.shape[0]]
        assert (p.grad - want).abs().max().item() < TOL, (kw, name)


def _check_all(rank, world):
    for seed, kw in enumerate(LAYOUTS):
        _check_layout(rank, world, kw, seed)
    return True


def test_expert_parallel_model_matches_single_process_float64():
    assert run_distributed(_check_all, world_size=4, timeout=300) == [True] * 4


def test_tp_cp_are_refused_with_an_actionable_error():
    dims = ParallelDims.from_config(ParallelConfig(tp=2), 2, tiny_config())
    with pytest.raises(ValueError, match="set parallel.tp=1"):
        parallelize(_model(0), dims)
