"""One `longctx-moe rehearse` of one rank, through the CLI's own entry point, for the rehearsal tests."""

import contextlib
import io
import json
import os
from pathlib import Path

from tests.launcher import run_forked

ROOT = Path(__file__).resolve().parents[2]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`longctx-moe ARGV` in this process, from the repository's root (the configs' paths are
    relative to it): (exit status, stdout, stderr)."""
    from longctx_moe.cli import main

    os.chdir(ROOT)  # this process is the rehearsal's own
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's refusals
            status = e.code
    return status, out.getvalue(), err.getvalue()


def rehearse_one(tmp_path, *args: str, sets: tuple = ()) -> dict:
    """The report of `longctx-moe rehearse ARGS` for its one rank, with each of `sets` a --set. The
    CLI's main runs in a process of its own (a rehearsal installs a fake world), forked from the
    tests' preloaded server."""
    out = tmp_path / "r.json"
    argv = ["rehearse", *args, "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    status, stdout, stderr = run_forked(_cli, argv)
    assert status == 0, stderr[-3000:]
    assert "peak GiB" in stdout
    (report,) = json.loads(out.read_text())["ranks"]
    return report
