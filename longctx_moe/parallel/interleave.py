"""Two micro-batches in flight: the forward of one runs while the other's expert all-to-all
travels (`parallel.micro_batches_in_flight=2`).

With one micro-batch, a rank that has launched its tokens' all-to-all can only compute what does
not depend on them (the shared expert, dispatch.py); with two, it can compute the other
micro-batch's attention, router and experts. `run_interleaved` runs the two forwards in two
threads that take turns: exactly one computes at any moment (so they never share the cores), and
the turn passes only where communication code is about to block on a transfer it has launched.
Each callable is given its `Turn`, a value the runtime puts into its micro-batch's DocLayout
(`in_flight`); the MoE layer passes it to the dispatcher, whose all-to-all waits call
`Turn.hand_over` (comm._Transfer.wait). Nothing is kept per thread. The schedule is therefore a fixed function of the
program, not of timing:

    A: ... launch a2a(A, 1) | B: ... launch a2a(B, 1) | A: wait, experts, launch combine(A, 1) |
    B: wait, experts, launch combine(B, 1) | A: wait, attention of layer 2, ... | ...

Every rank runs the same sequence, so every collective (the all-to-alls, the counts they exchange,
CP rings, TP reductions, statistics) is issued in the same order on all ranks, as a collective
backend requires. Each forward computes exactly what it computes alone (only the time it runs at
changes), so outputs, losses and, with the backward run per micro-batch in the usual order,
every gradient are bitwise those of one micro-batch at a time (tests/parallel/test_overlap.py).
The price is memory: both micro-batches' activations are live until their backward.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

import torch


class _Turns:
    """Strict alternation of two threads; a finished thread leaves the turn to the other."""

    def __init__(self):
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False, False]

    def wait_turn(self, me: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == me)

    def pass_turn(self, me: int) -> None:
        """Let the other thread run until it passes the turn back or finishes."""
        with self._cond:
            if self._done[1 - me]:
                return
            self._turn = 1 - me
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me)

    def finish(self, me: int) -> None:
        with self._cond:
            self._done[me] = True
            self._turn = 1 - me
            self._cond.notify_all()


class Turn:
    """One of two micro-batches in flight, while its forward runs: communication code launches
    its transfers asynchronously and calls `hand_over` right before blocking on one. Once the
    forward has ended (a recomputation in the backward reuses its layout) it is `active` no more:
    transfers are synchronous again, as for one micro-batch."""

    def __init__(self, turns: _Turns, me: int):
        self._turns, self._me = turns, me
        self.active = True

    def hand_over(self) -> None:
        """The other micro-batch runs until its own next transfer (or its end)."""
        if self.active:
            self._turns.pass_turn(self._me)


def run_interleaved(fns: list[Callable[[Turn | None], Any]]) -> list[Any]:
    """[fn(turn) for fn in fns] for one or two callables: one runs in the caller with turn
    None; two run in turns (module doc), each given its Turn, in a copy of the caller's context
    variables (cp_attention's batch-invariant switch) and grad mode. Autocast is not carried
    over: `fns` enter what they need. An exception in either is raised here after both threads
    have ended."""
    if len(fns) == 1:
        return [fns[0](None)]
    if len(fns) != 2:
        raise ValueError(f"run_interleaved takes one or two micro-batches, got {len(fns)}")
    turns = _Turns()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]
    contexts = [contextvars.copy_context() for _ in fns]  # one each: a context runs in one thread
    grad = torch.is_grad_enabled()

    def body(me: int) -> None:
        turn = Turn(turns, me)
        turns.wait_turn(me)
        try:
            with torch.set_grad_enabled(grad):
                results[me] = contexts[me].run(fns[me], turn)
        except BaseException as e:  # re-raised in the caller's thread
            errors[me] = e
        finally:
            turn.active = False
            turns.finish(me)

    threads = [threading.Thread(target=body, args=(i,), name=f"micro-batch-{i}") for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results
