"""The planner's choices move the right way, on a tiny model whose memory the program measures
in a second (its measurements cached per test under tmp_path)."""

from __future__ import annotations

import pytest

from longctx_moe.config import load_config
from longctx_moe.plan.cli import plan
from longctx_moe.plan.layouts import judge


def _tiny(**model):
    sets = ["train.autocast_dtype=bf16"] + [f"model.{k}={v}" for k, v in model.items()]
    return load_config("configs/tiny_cpu.yaml", sets)


def test_a_refused_layout_is_never_proposed(tmp_path):
    # 6 heads: TP 4 splits them unevenly, so the configuration refuses every TP-4 layout.
    # Known gap: on this tiny model the time model ranks TP-4 layouts below the 40 walked, so
    # the mutation judge() -> None does not fail this test yet; a plant among the fastest is due.
    cfg = _tiny(num_heads=6, num_kv_heads=2)
    result = plan(cfg, 4, "h100", "lognormal:256,0.5,1024", 16384, top=40, cache_dir=str(tmp_path))
    assert result["fit"], "no layout fit"
    assert all(judge(cfg, p.layout) is None for p in result["fit"])
    assert all(6 % p.layout.tp == 0 for p in result["fit"])


@pytest.mark.parametrize("gib", [0.02])
def test_more_memory_fewer_model_parallel_splits(tmp_path, gib):
    # Mutation tried: the fit check ignoring memory (p.peak <= inf) makes both plans equal and
    # this fails.
    cfg = _tiny()
    spec, tokens = "lognormal:256,0.5,1024", 16384
    small = plan(cfg, 4, "h100", spec, tokens, top=1, cache_dir=str(tmp_path), memory_bytes=int(gib * 2**30))
    large = plan(cfg, 4, "h100", spec, tokens, top=1, cache_dir=str(tmp_path), memory_bytes=80 * 2**30)
    assert small["fit"] and large["fit"]
    assert large["fit"][0].layout.model_parallel < small["fit"][0].layout.model_parallel
