"""The rehearsal's memory against the real program's: the tiny config's ranks run one optimizer
step for real (gloo ranks on this CPU) and rehearsed (meta, the fake group) with the same ops,
both measured by MemTracker; real over rehearsed peak must lie within 0.9-1.1 on every rank."""

import math

import pytest

from longctx_moe.config import load_config
from longctx_moe.rehearsal.truth import TOTAL, memory_truth
from tests.launcher import run_distributed

# a small micro-batch: three documents, one of them shorter than a TP / CP pad quantum
LENGTHS = [260, 500, 10]


def _truth(world: int, *sets: str):
    cfg = load_config("configs/tiny_cpu.yaml", list(sets))
    return memory_truth(cfg, world, LENGTHS, launch=run_distributed, timeout=240)


def _check(truth, world: int) -> None:
    assert [r.rank for r in truth.ranks] == list(range(world))
    for r in truth.ranks:
        # the parameters and the optimizer's state are the same tensors in both runs
        assert r.real["parameters"] == r.rehearsed["parameters"] > 0, r
        assert math.isclose(r.real["optimizer state"], r.rehearsed["optimizer state"], rel_tol=1e-3), r
        assert r.rehearsed["activations"] > 0
        assert 0.9 <= r.ratio <= 1.1, (r.rank, r.ratios())
    assert 0.9 <= truth.worst_ratio() <= 1.1
    # the comparison ran what it says: this CPU's compute dtype, torch where C++ cannot run on meta
    assert truth.ops["device"] == "cpu" and all(truth.ops[k.split(".")[1]] == "torch"
                                                 for k in truth.torch_instead_of_cpp)


@pytest.mark.slow
def test_the_rehearsed_peak_is_the_real_one_under_ep2_on_2_ranks_tp2_x_dp2_and_ep2_x_cp2_on_4():
    ep = _truth(2, "parallel.ep=2")
    _check(ep, 2)
    assert ep.layout["ep"] == 2 and ep.ranks[1].roles["ep"] == 1
    tp = _truth(4, "parallel.tp=2")
    _check(tp, 4)
    assert tp.layout["tp"] == 2 and {r.roles["dp"] for r in tp.ranks} == {0, 1}
    # a TP rank holds half the dense weights: fewer parameter bytes than an EP rank's
    assert tp.ranks[0].real["parameters"] < ep.ranks[0].real["parameters"]
    assert all(r.real[TOTAL] > 0 for r in ep.ranks + tp.ranks)
    # context parallelism: the ring's sends and receives rehearsed under the fake group
    cp = _truth(4, "parallel.ep=2", "parallel.cp=2")
    _check(cp, 4)
    assert {(r.roles["cp"], r.roles["ep"]) for r in cp.ranks} == {(0, 0), (1, 1)}
    # each CP rank holds half the tokens: less activation memory than the EP2 run's ranks
    assert max(r.real["activations"] for r in cp.ranks) < min(r.real["activations"] for r in ep.ranks)
