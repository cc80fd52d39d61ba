"""The verl plugin: importing this package registers the longctx_moe engine in verl's
EngineRegistry. verl imports it through `model.external_lib: rl_hooks.plugins.verl` (or the
VERL_USE_EXTERNAL_MODULES environment variable); then `strategy: longctx_moe` in the engine config
selects it. Needs the `verl` extra (pip install -e ".[verl]").

    config.py   LongctxMoeEngineConfig / LongctxMoeOptimizerConfig and their mapping to our Config
    engine.py   LongctxMoeEngine(WithLMHead): verl's BaseEngine over PolicyTrainer(sharded=True)
"""

from rl_hooks.plugins.verl.config import LongctxMoeEngineConfig, LongctxMoeOptimizerConfig
from rl_hooks.plugins.verl.engine import LongctxMoeEngine, LongctxMoeEngineWithLMHead

__all__ = ["LongctxMoeEngine", "LongctxMoeEngineConfig", "LongctxMoeEngineWithLMHead",
           "LongctxMoeOptimizerConfig"]
