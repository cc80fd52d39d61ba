"""interleave.run_interleaved: two callables, each given its Turn, take strict turns at
Turn.hand_over(); a finished one leaves the turn to the other; errors surface in the caller; one
callable runs alone with no Turn, and a Turn whose forward has ended hands over nothing."""

import contextvars

import pytest
import torch

from longctx_moe.parallel.interleave import run_interleaved


def _worker(name, steps, log):
    def run(turn):
        for i in range(steps):
            log.append(f"{name}{i}")
            if turn is not None:
                turn.hand_over()
        return name
    return run


def test_two_callables_alternate_at_each_hand_over_and_the_longer_one_finishes_alone():
    log = []
    assert run_interleaved([_worker("a", 3, log), _worker("b", 5, log)]) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "a2", "b2", "b3", "b4"]


def test_one_callable_runs_in_the_caller_without_a_turn():
    log = []
    assert run_interleaved([_worker("a", 2, log)]) == ["a"]
    assert log == ["a0", "a1"]
    assert run_interleaved([lambda turn: turn]) == [None]


def test_a_turn_is_active_while_its_callable_runs_and_inert_after():
    turns = run_interleaved([lambda turn: (turn, turn.active)] * 2)
    assert [active for _, active in turns] == [True, True]
    for turn, _ in turns:
        assert not turn.active
        turn.hand_over()  # a recomputation in the backward: returns at once, nothing to wait for


def test_an_error_in_one_is_raised_after_both_ended():
    log = []

    def fails(turn):
        log.append("x")
        turn.hand_over()
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
            seen = run_interleaved([lambda turn: (var.get(), torch.is_grad_enabled())] * 2)
    finally:
        var.reset(token)
    assert seen == [("caller", False)] * 2
    assert run_interleaved([lambda turn: torch.is_grad_enabled()] * 2) == [True, True]
