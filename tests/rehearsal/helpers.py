"""One `longctx-moe rehearse` of one rank, through the CLI's own entry point, for the rehearsal tests."""

import json
from pathlib import Path

from tests.launcher import run_script

ROOT = Path(__file__).resolve().parents[2]
# The console script's body: longctx-moe ARGV's status, stdout and stderr as the CLI gives them.
_CLI = "import sys\nfrom longctx_moe.cli import main\nsys.exit(main(sys.argv[1:]))"


def rehearse_one(tmp_path, *args: str, sets: tuple = ()) -> dict:
    """The report of `longctx-moe rehearse ARGS` for its one rank, with each of `sets` a --set. The
    CLI runs in a process of its own (a rehearsal installs a fake world), forked from the tests'
    preloaded server, from the repository's root (the configs' paths are relative to it)."""
    out = tmp_path / "r.json"
    argv = ["rehearse", *args, "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    done = run_script(_CLI, *argv, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "peak GiB" in done.stdout
    (report,) = json.loads(out.read_text())["ranks"]
    return report
