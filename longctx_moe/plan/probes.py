"""Where a plan's rehearsals run: several at once, in worker processes of their own.

A memory probe is independent rehearsals (two shrinks of the model, each at two token counts for
the activations), each seconds of one core's Python on meta tensors and nothing shared between
them, so a plan's cold walk is as many times faster as there are cores to run them, up to four.
The workers are spawned (torch allows one default process group per process, and each rehearsal
makes and ends its own fake one) when the plan starts, so that their imports overlap the plan's
timing of every candidate, and they are ended with it. `jobs=1` runs everything in this process.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Sequence

# a probe has at most four rehearsals to run at once (two shrinks x two token counts)
MAX_JOBS = 4


class WorkerDied(RuntimeError):
    """A probe's worker process ended without an answer: about this machine, not the layout."""


class WorkersUnavailable(Exception):
    """No worker process of a plan's pool started: every probe would fail alike, so the plan
    stops (not a RuntimeError, which the walk takes as a layout's refusal)."""


def default_jobs() -> int:
    """The cores this process may run on, up to MAX_JOBS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_JOBS, cores))


def _skip_teardown() -> None:
    """A worker's initializer: its interpreter ends without its teardown. Finalizing an
    interpreter that imported torch and ran rehearsals takes a worker half a second to a second,
    and the plan waits for its workers to end; the results are sent by then (the pool's result
    queue writes as it is put), nothing a worker holds needs finalizing, and the pool reads no
    exit status (a worker that dies early is seen by its process sentinel)."""
    import atexit

    # exit handlers run last registered first: those the imports after this one register run,
    # then this ends the process where the interpreter's teardown would begin
    atexit.register(os._exit, 0)


def _warm() -> None:
    """A worker's first task: the imports every rehearsal needs (while the plan times candidates),
    the program's parallel layer and optimizers, and torch's varlen attention, which the CUDA
    target's attention backend is resolved against and which imports torch's compiler (a
    second of a worker's first probe otherwise)."""
    import torch

    import longctx_moe.optim_offload  # noqa: F401
    import longctx_moe.parallel.parallelize  # noqa: F401
    import longctx_moe.plan.memory  # noqa: F401
    import longctx_moe.rehearsal.fake_world  # noqa: F401
    import longctx_moe.rehearsal.step  # noqa: F401
    from cp_attention.kernels import torch_varlen

    torch_varlen.unavailable_reason(torch.device("cuda"))  # imports it where this torch has it


class Probes:
    """Runs a probe's rehearsals: `run(fn, tasks)` -> [fn(*task) for task in tasks], in this
    process (jobs == 1) or over `jobs` worker processes. `fn` is a module-level function and its
    arguments pickle (configs, layouts, lengths); an exception a rehearsal raises is raised here."""

    def __init__(self, jobs: int = 1, warm: Callable[[], None] | None = None):
        if jobs < 1:
            raise ValueError(f"--jobs {jobs}: give 1 or more worker processes")
        self.jobs = jobs
        self._first_task = warm or _warm  # each worker's first task
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._warmed: list = []  # the futures of the workers' first tasks

    def start(self) -> None:
        """Spawn the workers now and have them import what a rehearsal needs."""
        if self.jobs > 1 and self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_skip_teardown)
            # one task each: the pool spawns a worker per waiting task
            self._warmed = [self._pool.submit(self._first_task) for _ in range(self.jobs)]

    def run(self, fn: Callable, tasks: Sequence[tuple]) -> list:
        if self.jobs == 1 or len(tasks) == 1:
            return [fn(*task) for task in tasks]
        self.start()
        try:
            futures = [self._pool.submit(fn, *task) for task in tasks]
            return [f.result() for f in futures]
        except concurrent.futures.process.BrokenProcessPool as e:
            started = any(f.done() and not f.cancelled() and f.exception() is None for f in self._warmed)
            self.close()
            if not started:  # at their start: multiprocessing spawns workers by importing __main__
                raise WorkersUnavailable(
                    "the plan's probe worker processes died as they started; call plan() from under "
                    "`if __name__ == \"__main__\":` in a script (each worker imports it), or pass jobs=1") from None
            # a worker died later (a crash, or the OS ended it): the layout is refused with why,
            # and the next probe gets new workers
            raise WorkerDied(f"a probe's worker process died ({e})") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
