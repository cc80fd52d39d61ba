"""One `longctx-moe rehearse` of one rank, as a user runs it, for the rehearsal tests."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rehearse_one(tmp_path, *args: str, sets: tuple = ()) -> dict:
    """The report of `longctx-moe rehearse ARGS` for its one rank, with each of `sets` a --set."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "longctx_moe.cli", "rehearse", *args, "--out", str(out)]
    cmd += [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "peak GiB" in done.stdout
    (report,) = json.loads(out.read_text())["ranks"]
    return report
