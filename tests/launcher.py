"""Run a function in N real `torch.distributed` processes (gloo on CPU) and collect the results.

Every distributed test goes through `run_distributed`:

    results = run_distributed(_check_ring, world_size=4, args=(seed,), timeout=300)

`fn(rank, world_size, *args)` must be a module-level function (processes are spawned, so it is
imported by name). The process group is initialised before `fn` runs and destroyed after it.
Each rank's stdout/stderr lines are prefixed with `[rank r]`. A failure on any rank is re-raised in
the parent with that rank's traceback; a rank that has not finished by `timeout` seconds (a
deadlock) fails the test instead of hanging CI, and all ranks are killed.

Start one process group per test and loop over many cases inside it. Ranks are forked from one
server process per test session that has imported torch and the project once (multiprocessing's
forkserver with a preload): a freshly spawned rank spends seconds of CPU importing them again,
which was most of a small test's time on a 2-core machine. Each rank still starts from the
parent's current environment and working directory, as a spawned one would.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# Imported once by the fork server (its children inherit them). torch._dynamo (with sympy and
# the rest it pulls in) is not imported by the project's modules but on first use: by every
# rank that builds a torch.optim optimizer. Left to the ranks it cost each ~1.3 CPU-s.
PRELOAD = ["torch", "torch.distributed", "numpy", "longctx_moe.trainer",
           "longctx_moe.parallel.parallelize", "cp_attention.ring", "cp_attention.ulysses",
           "torch._dynamo", "torch.utils.cpp_extension", "tests.launcher", "tests._fork_server"]


class DistributedTestError(RuntimeError):
    pass


# Set by tests/conftest.py around every test: raises when the running test may not start
# processes (the fast tier holds only each feature's one `multirank` test).
tier_check: Callable[[], None] | None = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PrefixedStream(io.TextIOBase):
    """Line-buffered writer that prefixes every line with the rank."""

    def __init__(self, stream, prefix: str):
        self._stream, self._prefix, self._buf = stream, prefix, ""

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self._stream.write(f"{self._prefix}{line}\n")
        self._stream.flush()
        return len(text)

    def flush(self) -> None:
        if self._buf:
            self._stream.write(f"{self._prefix}{self._buf}\n")
            self._buf = ""
        self._stream.flush()


def _worker(fn, rank, world_size, port, args, kwargs, result_q, backend, threads, env, cwd):
    import torch
    import torch.distributed as dist

    from longctx_moe.parallel.dims import destroy_process_groups
    from longctx_moe.process import import_before_init

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.stdout = _PrefixedStream(sys.__stdout__, f"[rank {rank}] ")
    sys.stderr = _PrefixedStream(sys.__stderr__, f"[rank {rank}] ")
    # Oversubscribing 2 cores with N ranks x N OpenMP threads makes every test crawl.
    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import_before_init()
        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensors into the message: the queue's own pickler would share
        # their storage by file descriptor, which dies with this process before the parent
        # reads it ("No such file or directory" in the parent).
        result_q.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result_q.put((rank, "error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            destroy_process_groups()
        except Exception:  # noqa: BLE001 - a peer died; nothing to tidy
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return results by rank."""
    if tier_check is not None:
        tier_check()
    try:
        return _run_once(fn, world_size, args, kwargs, timeout, backend, threads_per_rank)
    except DistributedTestError as e:
        if not _port_taken(str(e)):
            raise
    # The port free_port found was taken before rank 0's store listened on it (make test runs
    # several workers, each launching ranks): once more on another port.
    return _run_once(fn, world_size, args, kwargs, timeout, backend, threads_per_rank)


def _call(rank: int, world_size: int, fn: Callable[..., Any], *args) -> Any:
    return fn(*args)


def run_forked(fn: Callable[..., Any], *args, timeout: float = 300.0) -> Any:
    """`fn(*args)` in one process forked from the preloaded server, with no process group: a
    program's entry point (a CLI's `main`) kept out of the test's process, without the ~3 CPU-s
    a fresh interpreter spends importing torch, torch._dynamo and the project again."""
    if tier_check is not None:
        tier_check()
    return _run_once(_call, 1, (fn, *args), None, timeout, None, 1)[0]


def _script(source: str, argv: tuple[str, ...], cwd: str) -> subprocess.CompletedProcess:
    os.chdir(cwd)
    sys.argv = ["-c", *argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(source, "<script>", "exec"), {"__name__": "__main__"})
            status = 0
        except SystemExit as e:  # as the interpreter ends on one: a message goes to stderr, status 1
            if e.code is None or isinstance(e.code, int):
                status = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                status = 1
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
            traceback.print_exc()
            status = 1
    return subprocess.CompletedProcess(["-c", *argv], status, out.getvalue(), err.getvalue())


def run_script(source: str, *argv: str, cwd: str | os.PathLike = ".", timeout: float = 300.0):
    """`python -c SOURCE ARGV...` in a process forked from the preloaded server: the script's
    status, stdout and stderr as subprocess.run(capture_output=True, text=True) gives them. For
    scripts that need a process of their own (a fake process group, say), not a fresh
    interpreter: whatever must run before torch's import needs subprocess."""
    return run_forked(_script, source, argv, os.fspath(cwd), timeout=timeout)


def _port_taken(error: str) -> bool:
    return any(m in error for m in ("EADDRINUSE", "ddress already in use"))


def _run_once(fn, world_size, args, kwargs, timeout, backend, threads_per_rank) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first call)
    result_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, args, kwargs or {}, result_q, backend, threads_per_rank,
                  dict(os.environ), os.getcwd()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    finished = False
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise DistributedTestError(
                    f"ranks {missing} did not finish within {timeout:.0f}s (deadlock?)"
                    + _format_errors(errors)
                )
            try:
                rank, status, payload = result_q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} before reporting"
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors and any(_port_taken(tb) for tb in errors.values()):
                break  # rank 0's store never listened: no peer gets further, and the launch is retried
            if errors:
                # One rank failed: its peers are likely blocked in a collective; give them a
                # moment to report their own error, then stop waiting.
                deadline = min(deadline, time.monotonic() + 10.0)
        if errors:
            raise DistributedTestError(_format_errors(errors))
        finished = True
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5 if finished else 0)
            if p.is_alive():
                p.kill()
                p.join()


def _format_errors(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
