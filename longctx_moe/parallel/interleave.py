"""Two micro-batches in flight: the forward of one runs while the other's expert all-to-all
travels (`parallel.micro_batches_in_flight=2`).

With one micro-batch, a rank that has launched its tokens' all-to-all can only compute what does
not depend on them (the shared expert, dispatch.py); with two, it can compute the other
micro-batch's attention, router and experts. `run_interleaved` runs the two forwards in two
threads that take turns: exactly one computes at any moment (so they never share the cores), and
the turn passes only where communication code is about to block on a transfer it has launched
(`hand_over`, called by comm._Transfer.wait). The schedule is therefore a fixed function of the
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

_local = threading.local()


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


def hand_over() -> None:
    """Called right before blocking on a launched transfer: in a thread of `run_interleaved`, the
    other micro-batch runs until its own next transfer (or its end); elsewhere a no-op."""
    slot = getattr(_local, "slot", None)
    if slot is not None:
        turns, me = slot
        turns.pass_turn(me)


def interleaving() -> bool:
    """Whether this thread is one of two micro-batches in flight (communication code then
    launches its transfers asynchronously, so there is a window to hand over)."""
    return getattr(_local, "slot", None) is not None


def run_interleaved(fns: list[Callable[[], Any]]) -> list[Any]:
    """[fn() for fn in fns] for one or two callables; two run in turns (module doc), each in a
    copy of the caller's context variables (cp_attention's batch-invariant switch) and grad
    mode. Autocast is not carried over: `fns` enter what they need. An exception in either is
    raised here after both threads have ended."""
    if len(fns) == 1:
        return [fns[0]()]
    if len(fns) != 2:
        raise ValueError(f"run_interleaved takes one or two micro-batches, got {len(fns)}")
    turns = _Turns()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]
    contexts = [contextvars.copy_context() for _ in fns]  # one each: a context runs in one thread
    grad = torch.is_grad_enabled()

    def body(me: int) -> None:
        _local.slot = (turns, me)
        turns.wait_turn(me)
        try:
            with torch.set_grad_enabled(grad):
                results[me] = contexts[me].run(fns[me])
        except BaseException as e:  # re-raised in the caller's thread
            errors[me] = e
        finally:
            _local.slot = None
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
