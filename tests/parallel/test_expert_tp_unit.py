"""ETP building blocks on 2 gloo ranks, float64, against the unsplit GroupedExperts:

- shard_expert_hidden: each rank's slice of w_gate_up [L, D, 2, F], read as [L, D, 2u], is
  [gate | up] of its own hidden units; w_down keeps the rows of those units.
- experts_over_etp: rows held by either peer (uneven counts, a rank or a whole group without
  rows) give the unsplit experts' outputs and input / weight gradients within 1e-12.
- the same with gpt-oss's experts (model.expert_proj_bias, clamped SwiGLU with a limit the rows
  cross): b_gate_up follows its hidden units, b_down is split along D and added once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.model.experts import GroupedExperts
from longctx_moe.parallel.dispatch import experts_over_etp
from longctx_moe.parallel.expert_parallel import shard_expert_hidden
from longctx_moe.parallel.sharding import Split, splits_of
from tests.launcher import run_distributed

L, D, F = 3, 8, 6  # local experts, model dim, expert hidden (F / 2 = 3 units per rank)
TOL = 1e-12


GPT_OSS = dict(bias=True, activation="clamped_swiglu", limit=0.5)


def _experts(kind: dict) -> GroupedExperts:
    torch.manual_seed(0)
    ex = GroupedExperts(L, D, F, **kind).double()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(std=0.5)
    return ex


def _check_layout(rank, size, kind):
    full = _experts(kind)
    ex = shard_expert_hidden(_experts(kind), rank, size)
    assert splits_of(ex.w_gate_up) == (Split("etp", 3, size, rank),)
    assert splits_of(ex.w_down) == (Split("etp", 1, size, rank),)
    u = F // size
    units = slice(rank * u, (rank + 1) * u)
    want = torch.cat([full.w_gate_up[:, :, 0, units], full.w_gate_up[:, :, 1, units]], dim=2)
    assert torch.equal(ex.w_gate_up.flatten(2), want)
    assert torch.equal(ex.w_down, full.w_down[:, units])
    if kind:
        cols = slice(rank * D // size, (rank + 1) * D // size)
        assert splits_of(ex.b_gate_up) == (Split("etp", 2, size, rank),)
        assert splits_of(ex.b_down) == (Split("etp", 1, size, rank),)
        assert torch.equal(ex.b_gate_up, full.b_gate_up[..., units])
        assert torch.equal(ex.b_down, full.b_down[:, cols]) and ex.down_bias_offset == cols.start


def _check_over_etp(rank, size, group, counts_by_rank, kind):
    full, ex = _experts(kind), shard_expert_hidden(_experts(kind), rank, size)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(sum(c), D, generator=gen, dtype=torch.float64) for c in counts_by_rank]
    gs = [torch.randn(sum(c), D, generator=gen, dtype=torch.float64) for c in counts_by_rank]
    x = xs[rank].clone().requires_grad_()
    y = experts_over_etp(ex, x, torch.tensor(counts_by_rank), group)  # every peer's rows, host
    (y * gs[rank]).sum().backward()
    ref_out, ref_dx = [], []
    for xr, gr, c in zip(xs, gs, counts_by_rank, strict=True):
        xr = xr.clone().requires_grad_()
        yr = full(xr, torch.tensor(c))
        (yr * gr).sum().backward()
        ref_out.append(yr.detach())
        ref_dx.append(xr.grad)
    assert (y - ref_out[rank]).abs().max() <= TOL if y.numel() else y.shape == ref_out[rank].shape
    if x.numel():
        assert (x.grad - ref_dx[rank]).abs().max() <= TOL
    u = F // size
    want_down = full.w_down.grad[:, rank * u:(rank + 1) * u]
    want_gu = full.w_gate_up.grad[..., rank * u:(rank + 1) * u]
    assert (ex.w_down.grad - want_down).abs().max() <= TOL
    assert (ex.w_gate_up.grad - want_gu).abs().max() <= TOL
    if kind:  # b_down's columns: every row's whole gradient there (the sum over ETP is complete)
        cols = slice(rank * D // size, (rank + 1) * D // size)
        assert (ex.b_gate_up.grad - full.b_gate_up.grad[..., rank * u:(rank + 1) * u]).abs().max() <= TOL
        assert (ex.b_down.grad - full.b_down.grad[:, cols]).abs().max() <= TOL


def _rank(rank, world):
    group = dist.group.WORLD
    for kind in ({}, GPT_OSS):
        _check_layout(rank, world, kind)
        for counts in ([[2, 0, 3], [1, 4, 0]], [[0, 0, 0], [2, 1, 1]], [[0, 0, 0], [0, 0, 0]]):
            _check_over_etp(rank, world, group, counts, kind)
    return True


@pytest.mark.slow
def test_etp_slices_and_experts_over_etp_equal_unsplit_experts():
    assert run_distributed(_rank, 2, timeout=120) == [True, True]
