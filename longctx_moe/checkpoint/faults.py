"""A test hook: a rank SIGKILLs itself at a named point of a step (save, prune, step)."""

from __future__ import annotations

import os
import signal

# Test hook (tests/trainer/test_faults.py): "WHERE:STEP:RANK" makes that rank SIGKILL itself at
# that point of that step, on the first attempt of an elastic run only.
KILL_ENV = "LONGCTX_MOE_TEST_KILL"


def kill_point(where: str, step: int, rank: int) -> None:
    if os.environ.get(KILL_ENV) == f"{where}:{step}:{rank}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
