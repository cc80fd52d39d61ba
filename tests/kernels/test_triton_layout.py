"""Triton route layout (counting sort of the routed copies by expert) against the torch path,
moe.permute_layout without padding: the same rows and counts exactly (integers)."""

from __future__ import annotations

import pytest
import torch

from longctx_moe.kernels import LAUNCHES_PER_CALL, triton_ops
from longctx_moe.model.moe import permute_layout

pytestmark = pytest.mark.triton


def _ids(t, k, e, seed, skip=None):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if skip is not None:  # an expert no copy goes to
        idx = torch.where(idx == skip, (skip + 1) % e, idx)
    return idx


@pytest.mark.parametrize("t,k,e,skip", [(37, 2, 5, 3), (300, 3, 12, None), (129, 1, 8, 0), (1, 4, 6, None),
                                        (2100, 2, 7, None)])
def test_route_layout_equals_the_stable_sort(t, k, e, skip):
    """Several blocks of 128 copies (the last partial), E not a power of two, an empty expert,
    and more blocks (33) than the scan adds in one iteration (32)."""
    idx = _ids(t, k, e, seed=t, skip=skip)
    slot, counts = triton_ops().route_layout(idx, e)
    ref_slot, ref_counts, total = permute_layout(idx, e, pad=False)
    assert slot.dtype == counts.dtype == torch.int64 and total == t * k
    assert torch.equal(slot, ref_slot) and torch.equal(counts, ref_counts)


def test_ties_keep_token_order():
    """Every copy to one expert: rows in token-major order, across blocks (stability)."""
    idx = torch.zeros(200, 2, dtype=torch.int64)
    idx[:, 1] = 1
    slot, counts = triton_ops().route_layout(idx, 3)
    assert torch.equal(counts, torch.tensor([200, 200, 0]))
    assert torch.equal(slot[:, 0], torch.arange(200)) and torch.equal(slot[:, 1], torch.arange(200, 400))


def test_launches_and_meta(launches):
    idx = _ids(300, 2, 8, seed=1)
    triton_ops().route_layout(idx, 8)
    assert len(launches) == 3 == LAUNCHES_PER_CALL["longctx.route_layout"]  # what the step's counts take
    launches.clear()
    slot, counts = triton_ops().route_layout(idx.to("meta"), 8)
    assert not launches and slot.shape == (300, 2) and counts.shape == (8,) and slot.device.type == "meta"


def test_opcheck():
    torch.library.opcheck(torch.ops.longctx.route_layout, (_ids(37, 2, 5, seed=2), 5))


def test_refuses_float_ids():
    with pytest.raises(ValueError, match="int32 or int64"):
        triton_ops().route_layout(torch.zeros(3, 2), 4)
