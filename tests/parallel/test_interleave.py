"""interleave.run_interleaved: two callables take strict turns at hand_over(); a finished one
leaves the turn to the other; errors surface in the caller; outside it hand_over is a no-op."""

import contextvars

import pytest
import torch

from longctx_moe.parallel.interleave import hand_over, interleaving, run_interleaved


def _worker(name, steps, log):
    def run():
        for i in range(steps):
            log.append(f"{name}{i}")
            hand_over()
        return name
    return run


def test_two_callables_alternate_at_each_hand_over_and_the_longer_one_finishes_alone():
    log = []
    assert run_interleaved([_worker("a", 3, log), _worker("b", 5, log)]) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "a2", "b2", "b3", "b4"]


def test_one_callable_runs_in_the_caller_and_hand_over_is_a_no_op_outside():
    log = []
    assert run_interleaved([_worker("a", 2, log)]) == ["a"]
    assert log == ["a0", "a1"] and not interleaving()
    hand_over()
    assert run_interleaved([interleaving, interleaving]) == [True, True]


def test_an_error_in_one_is_raised_after_both_ended():
    log = []

    def fails():
        log.append("x")
        hand_over()
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        run_interleaved([fails, _worker("b", 3, log)])
    assert log == ["x", "b0", "b1", "b2"]
    with pytest.raises(ValueError, match="one or two"):
        run_interleaved([fails] * 3)


def test_the_callers_context_variables_and_grad_mode_reach_both_threads():
    var = contextvars.ContextVar("v", default="unset")
    token = var.set("caller")
    try:
        with torch.no_grad():
            seen = run_interleaved([lambda: (var.get(), torch.is_grad_enabled())] * 2)
    finally:
        var.reset(token)
    assert seen == [("caller", False)] * 2
    assert run_interleaved([torch.is_grad_enabled] * 2) == [True, True]
