"""GRPO on digit reversal with a tiny MoE, on a CPU, in a few minutes (see rl_hooks/demo.py).

    python examples/grpo_digits.py [--config configs/grpo_tiny.yaml] [--set rl.grpo.steps=50 ...]

The same as `longctx-moe rl --config configs/grpo_tiny.yaml`: the loop lives in the package
(rl_hooks.demo) so that the installed command runs it too.
"""

import sys
from pathlib import Path

from rl_hooks.demo import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--config" not in argv:
        config = Path(__file__).resolve().parents[1] / "configs" / "grpo_tiny.yaml"
        argv = ["--config", str(config), *argv]
    sys.exit(main(argv))
