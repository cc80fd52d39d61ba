"""bench/family_parity.py's route-flip accounting: a flip at a near-tie is rounding, a flip with
a wide gap is a mismatch, and float64 decides between rounding and a real difference."""

import torch

from bench.family_parity import NEAR_TIE, _route_flips, _selection_gap_T, _verdict
from longctx_moe.model.moe import Router
from tests.model.helpers import tiny_config


def _router(**overrides) -> Router:
    return Router(tiny_config(num_experts=4, top_k=1, **overrides))


def test_flips_carry_their_document_position_and_decision_gap():
    router = _router(router_score="softmax")
    logits_TE = torch.tensor([[0.5, 0.1, 0.0, 0.0],
                              [1.0, 1.0 + 1e-7, 0.0, 0.0],  # experts 0 and 1 tie up to rounding
                              [2.0, 0.0, 0.0, 0.0]])
    mine = {0: [(torch.tensor([[0], [1], [1]]), router, logits_TE)]}
    theirs = {0: [torch.tensor([[0]]), torch.tensor([[0], [0]])]}  # documents of 1 and 2 tokens
    flips = _route_flips(mine, theirs, [0, 1, 3])
    assert [(f["layer"], f["doc"], f["pos"]) for f in flips] == [(0, 1, 0), (0, 1, 1)]
    assert flips[0]["gap"] < NEAR_TIE < flips[1]["gap"]


def test_the_gap_of_group_limited_routing_includes_the_group_decision():
    router = _router(router_score="sigmoid", router_groups=2, router_topk_groups=1)
    # group scores 0.9 + 0.8 and 0.85 + (0.85 - 1e-9) are 1e-9 apart; the best experts 0.05
    probs_TE = torch.tensor([[0.9, 0.8, 0.85, 0.85 - 1e-9]], dtype=torch.float64)
    gap_T = _selection_gap_T(router, torch.logit(probs_TE))
    assert gap_T.item() < NEAR_TIE


def test_float64_decides_between_rounding_and_a_mismatch():
    assert _verdict(1e-6, 1e-14) == "ok"
    assert _verdict(5e-5, 1e-14) == "float32 rounding over tolerance"
    assert _verdict(1e-6, 1e-7) == "mismatch"
