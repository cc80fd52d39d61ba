"""Gradient / count reductions on 4 gloo ranks in several folded layouts, against one process.

A tiny tokenwise model (dense layer -> softmax router -> EP experts) sees the global batch split
over DP x CP (TP peers get the same tokens and split them between them via tp_group, as the
production dispatchers do); after reduce_gradients every rank's dense gradients and its expert shard's gradients
must equal the unsharded float64 ones (1e-10: only the summation order differs).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.dispatch import AllToAllDispatcher
from longctx_moe.parallel.grad_reduce import (
    clip_grad_norm,
    reduce_gradients,
    split_params,
    stats_reducer,
)
from tests.launcher import run_distributed
from tests.parallel._moe_ref import LoopExperts
from tests.parallel.test_dims import check_groups_on_gloo

E, D, F, K, T = 8, 6, 5, 2, 24
TOL = 1e-10
LAYOUTS = [
    dict(tp=1, cp=2, ep=2),
    dict(tp=2, cp=1, ep=4),
    dict(tp=2, cp=1, ep=2),  # the EP group is the TP pair
    dict(cp=4, ep=2, cp_backend="hierarchical", hierarchical_sizes=[2, 2]),
]


class TinyMoE(nn.Module):
    def __init__(self, wd, wr, w1, w2, offset, count):
        super().__init__()
        self.dense = nn.Parameter(wd.clone())
        self.router = nn.Parameter(wr.clone())
        self.experts = LoopExperts(w1, w2, offset, count)

    def forward(self, x_TD, dispatcher):
        h_TD = torch.tanh(x_TD @ self.dense)
        probs_TE = torch.softmax(h_TD @ self.router, dim=1)
        idx_TK = torch.topk(probs_TE, K, dim=1).indices
        return dispatcher(h_TD, idx_TK, probs_TE.gather(1, idx_TK), self.experts), idx_TK


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(T, D), (D, D), (D, E), (E, D, F), (E, F, D), (T, D)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) / 2 for s in shapes]


def _reference(x, wd, wr, w1, w2, g):
    model = TinyMoE(wd, wr, w1, w2, 0, E)
    y, idx = model(x, AllToAllDispatcher(E, None))  # ep=1: no communication, loop experts
    ((y * g).sum() / T).backward()
    return model, idx


def _check_layout(rank, kw, seed):
    dims = ParallelDims.from_config(ParallelConfig(**kw), 4)
    dims.build_groups(rank)
    x, wd, wr, w1, w2, g = _data(seed)
    ref, ref_idx = _reference(x, wd, wr, w1, w2, g)
    chunk = dims.rank_in("dp") * dims.cp + dims.rank_in("cp")
    s = slice(chunk * T // (dims.dp * dims.cp), (chunk + 1) * T // (dims.dp * dims.cp))
    L = E // dims.ep
    model = TinyMoE(wd, wr, w1, w2, dims.rank_in("ep") * L, L)
    tp_group = dims.group_or_none("tp")
    y, idx = model(x[s], AllToAllDispatcher(E, dims.group("ep"), tp_group=tp_group))
    ((y * g[s]).sum() / T).backward()  # the global token count, as the trainer does
    dense, expert = split_params(model)
    assert [p is model.dense or p is model.router for p in dense] == [True, True] and len(expert) == 2
    reduce_gradients(dense, expert, dims)
    e = slice(dims.rank_in("ep") * L, dims.rank_in("ep") * L + L)
    pairs = [(model.dense, ref.dense.grad), (model.router, ref.router.grad),
             (model.experts.w1_LDF, ref.experts.w1_LDF.grad[e]),
             (model.experts.w2_LFD, ref.experts.w2_LFD.grad[e])]
    for p, want in pairs:
        assert (p.grad - want).abs().max().item() < TOL, (kw, p.shape)
    _check_counts(dims, idx, ref_idx)
    # Clipping: the global norm of the full model's gradients, then the same scaled gradients.
    ref_params = [ref.dense, ref.router, ref.experts.w1_LDF, ref.experts.w2_LFD]
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5 * _norm(ref_params))
    norm = clip_grad_norm(dense, expert, dims, max_norm=0.5 * float(ref_norm))
    assert abs(float(norm) - float(ref_norm)) < TOL, kw
    clipped = [ref.dense.grad, ref.router.grad, ref.experts.w1_LDF.grad[e], ref.experts.w2_LFD.grad[e]]
    for (p, _), want in zip(pairs, clipped, strict=True):
        assert (p.grad - want).abs().max().item() < TOL, (kw, "clipped", p.shape)


def _norm(params):
    return float(torch.cat([p.grad.reshape(-1) for p in params]).norm())


def _check_counts(dims, idx, ref_idx):
    """Router statistics: summed over cp they are this DP replica's (TP peers already hold it
    all), over dp_cp the whole batch's; the input is left unchanged."""
    count = lambda i: torch.bincount(i.flatten(), minlength=E)
    mine = count(idx)
    per_replica = T // dims.dp
    d = dims.rank_in("dp")
    replica = count(ref_idx[d * per_replica:(d + 1) * per_replica])
    assert torch.equal(stats_reducer(dims.group("cp"))(mine), replica)
    assert torch.equal(stats_reducer(dims.group("dp_cp"))(mine), count(ref_idx))
    assert torch.equal(mine, count(idx)) and stats_reducer(None) is None


def _check_all_layouts(rank, world):
    check_groups_on_gloo(rank, world)
    for seed, kw in enumerate(LAYOUTS):
        _check_layout(rank, kw, seed)
    return True


@pytest.mark.slow
def test_groups_and_reductions_match_unsharded_in_folded_layouts():
    assert run_distributed(_check_all_layouts, world_size=4, timeout=300) == [True] * 4
