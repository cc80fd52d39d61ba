"""A test hook: a rank SIGKILLs itself at a named point of a step (save, prune, step)."""

from __future__ import annotations

import os
import signal

# Test hook (tests/trainer/test_faults.py): "WHERE:STEP:RANK" makes that rank SIGKILL itself at
# that point of that step, on the first attempt of an elastic run only; a comma-separated list
# names one kill per attempt ("save:4:1,step:7:2": the first attempt dies saving step 4, the
# restarted one as step 7 starts).
KILL_ENV = "LONGCTX_MOE_TEST_KILL"


def kill_point(where: str, step: int, rank: int) -> None:
    kills = os.environ.get(KILL_ENV, "").split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(kills) and kills[attempt] == f"{where}:{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)
