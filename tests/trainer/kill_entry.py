"""`longctx-moe` with deterministic kills, for the crash tests: a rank SIGKILLs itself at a named
point of a step. The production modules hold no hook: this entry wraps their functions from
outside, in every rank, before the trainer runs.

    python -m tests.trainer.kill_entry train --nproc 2 --max-restarts 2 --config ... --set ...

with KILL_ENV set to "WHERE:STEP:RANK": that rank dies at that point of that step, on the first
attempt of an elastic run only; a comma-separated list names one kill per attempt ("save:4:1,
step:7:2": the first attempt dies saving step 4, the restarted one as step 7 starts). Points:

- step:  as the optimizer step STEP starts (before its first forward);
- save:  while writing its rank file of step STEP, before a byte of it is written;
- prune: rank 0 while pruning step STEP, after its meta.json is gone, before its files are.

The launcher is `longctx-moe train`'s own (`longctx_moe.cli`); only the module its ranks run is
this one, which installs the kills and then runs `longctx_moe.train.main`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from pathlib import Path

KILL_ENV = "LONGCTX_MOE_TEST_KILL"
# First argument of a rank started by the launcher below (the launcher's own argv is the CLI's).
RANK_FLAG = "--kill-entry-rank"
MODULE = "tests.trainer.kill_entry"


def _kill_if(where: str, step: int, rank: int) -> None:
    kills = os.environ.get(KILL_ENV, "").split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(kills) and kills[attempt] == f"{where}:{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class _PruneKillingShutil:
    """`shutil` as checkpoint/steps.py sees it: rmtree of a published step directory (pruning:
    meta.json already removed) first passes the "prune" point."""

    def __getattr__(self, name):
        return getattr(shutil, name)

    @staticmethod
    def rmtree(path, *args, **kwargs):
        from longctx_moe.checkpoint.steps import SUPERSEDED, step_number

        path = Path(path)
        number = step_number(path.name)
        if number is not None and path.parent.name != SUPERSEDED and not (path / "meta.json").exists():
            _kill_if("prune", number, 0)  # rank 0 alone prunes
        return shutil.rmtree(path, *args, **kwargs)


def install_kills(patch=setattr) -> None:
    """Wrap the trainer's step, the rank-file write and the pruning's removal (see the module
    docstring) so that they pass their kill points first; `patch(owner, name, value)` installs
    each wrapper (a test passes monkeypatch.setattr to undo them afterwards)."""
    from longctx_moe.checkpoint import save, steps
    from longctx_moe.trainer import Trainer

    train_step = Trainer.train_step

    def killing_train_step(self, *args, **kwargs):
        _kill_if("step", self.step + 1, _rank())
        return train_step(self, *args, **kwargs)

    write_rank_file = save.write_rank_file

    def killing_write_rank_file(path, *args, **kwargs):
        # write_staged writes `.step_NNNNNNNN.tmp/rank_RRRRR.safetensors`
        path = Path(path)
        step = steps.step_number(path.parent.name.removeprefix(".").removesuffix(".tmp"))
        _kill_if("save", step, int(re.fullmatch(r"rank_(\d+)\.safetensors", path.name).group(1)))
        return write_rank_file(path, *args, **kwargs)

    patch(Trainer, "train_step", killing_train_step)
    patch(save, "write_rank_file", killing_write_rank_file)
    patch(steps, "shutil", _PruneKillingShutil())


def _ranks_run_this_module() -> None:
    """torchrun's `run`, as `longctx-moe train --nproc` calls it, with the ranks started as this
    module (RANK_FLAG first) instead of `longctx_moe.train`."""
    import torch.distributed.run as torchrun

    run = torchrun.run

    def run_kill_entry(args):
        assert args.module and args.training_script == "longctx_moe.train", args.training_script
        args.training_script = MODULE
        args.training_script_args = [RANK_FLAG, *args.training_script_args]
        return run(args)

    torchrun.run = run_kill_entry


def main(argv: list[str]) -> int:
    install_kills()  # a run without --nproc / --max-restarts trains in this very process
    if argv[:1] == [RANK_FLAG]:
        from longctx_moe.train import main as train_main

        return train_main(argv[1:])
    _ranks_run_this_module()
    from longctx_moe.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
