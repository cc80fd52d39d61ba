"""execution.fp8=torch under expert parallelism through the Trainer, on gloo with the GPU refusal
lifted (CPU GEMMs stand in for the GPU's): every recipe trains with EP=2 and the fp8
dispatch (the block recipe reading the dispatched payload), both ranks agree on each step's
global loss, and the delayed recipe's histories advance at every optimizer step on each rank.
The per-tensor recipes' GEMMs run through tests/kernels/scaled_mm.py's float32 stand-in for
torch._scaled_mm, which judges each call as cuBLAS would (CPU's own op, a reference loop, made
this a minute per recipe)."""

import math

import pytest
import torch

from tests.launcher import run_distributed


def _train(rank, world, recipe):
    from longctx_moe.build import model_of
    from longctx_moe.config import load_config
    from longctx_moe.kernels import fp8
    from longctx_moe.parallel.dims import ParallelDims
    from longctx_moe.parallel.parallelize import parallelize
    from longctx_moe.trainer import Trainer
    from tests.kernels import scaled_mm
    from tests.model.helpers import packed_batch

    fp8.unavailable_reason = lambda *a, **k: None  # as on an FP8 GPU
    scaled_mm.install()
    sets = ["model.vocab_size=256", "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
            "model.num_kv_heads=4", "model.head_dim=32", "model.num_experts=4", "model.expert_hidden_size=128",
            "parallel.ep=2", "parallel.dispatch_dtype=fp8", "execution.fp8=torch", f"execution.fp8_recipe={recipe}",
            "optim.lr=3e-3", "optim.warmup_steps=1", "train.autocast_dtype=none"]
    cfg = load_config(None, sets)
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
    dims.build_groups(rank)
    torch.manual_seed(0)
    trainer = Trainer(cfg, parallelize(model_of(cfg), dims, cfg.parallel))
    losses, scales = [], []
    for step in range(4):
        gen = torch.Generator().manual_seed(10 * step + dims.rank_in("dp"))
        losses.append(trainer.train_step([packed_batch([60, 100, 96], 256, generator=gen)]).loss)
        scaling = trainer.model.layers[0].ffn.experts.fp8_scaling
        scales.append(None if recipe != "delayed" else float(scaling.x.scale))
    return {"losses": losses, "scales": scales}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensor", "delayed", "block"])
def test_every_fp8_recipe_trains_under_expert_parallelism(recipe):
    r0, r1 = run_distributed(_train, world_size=2, timeout=300, args=(recipe,))
    assert r0["losses"] == r1["losses"] and all(math.isfinite(x) and 0 < x < 10 for x in r0["losses"])
    if recipe == "delayed":  # a scale frozen after every step, from that rank's own history
        assert all(s is not None and s > 0 for s in r0["scales"] + r1["scales"])
