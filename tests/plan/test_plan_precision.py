"""The planner's precision choices (FP8 GEMMs, bf16 parameters, AdamW on the host): priced in time
by the rules timing.py states, enumerated only where the program runs them, and written into the
config a user would run. Memory is stubbed where it is not the rule under test."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from longctx_moe.config import load_config
from longctx_moe.plan import floors, layouts, memory, timing
from longctx_moe.plan.cli import param_counts, plan
from longctx_moe.plan.layouts import Layout
from longctx_moe.rehearsal.cost import HostStep, host_optimizer_seconds
from longctx_moe.rehearsal.gpus import GPUS

MIB = 2**20
H100 = GPUS["h100"]
COUNTS = (200_000_000, 800_000_000)  # (dense, expert) parameters: the time model's input, stubbed


def _tiny(**model):
    sets = ["train.autocast_dtype=bf16"] + [f"model.{k}={v}" for k, v in model.items()]
    return load_config("configs/tiny_cpu.yaml", sets)


def _work(tokens: int = 65536, doc: int = 2048, micro_batches: int = 4) -> timing.Workload:
    """`tokens` in documents of `doc` tokens, a rank's micro-batch 1 / micro_batches of them."""
    return timing.Workload(np.full(tokens // doc, doc), tokens // micro_batches)


def _layout(**kw) -> Layout:
    base = dict(tp=1, cp=1, cp_backend="ring", cp_inner=1, ep=1, etp=1, dynamic_cp=False, recompute="none",
                distributed_optimizer=False, world=1)
    return Layout(**{**base, **kw})


def _compute(cfg, micro_batches: int = 1, **kw) -> float:
    work = _work(micro_batches=micro_batches)
    return timing.step_time(cfg.model, H100, "h100", _layout(**kw), work, param_counts(cfg))["compute_s"]


def test_fp8_speeds_up_wide_gemms_and_pays_its_quantizing_on_narrow_ones():
    """Fails if FP8 GEMMs are priced at the bf16 rate (a GEMM-bound layout would not get faster),
    or if the quantize traffic around them is left out (a narrow model would get faster too)."""
    # Widths of 16K-64K: each FP8 GEMM's K N / (K + N) is far above the ~2,700 where its GEMM
    # time saved pays for quantizing its operands; one micro-batch, so the weights (4 experts,
    # 2 of them active) are quantized once.
    wide = _tiny(hidden_size=16384, num_heads=128, num_kv_heads=128, head_dim=128, num_experts=4,
                 expert_hidden_size=32768, dense_hidden_size=32768)
    assert _compute(wide, fp8=True) < 0.9 * _compute(wide)
    # Widths of 1K: quantizing costs more than the GEMMs it speeds up (K N / (K + N) = 512),
    # though the layout copies of the FP8 operands alone would not.
    narrow = _tiny(hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128, expert_hidden_size=1024)
    assert _compute(narrow, fp8=True) > _compute(narrow)


def test_fp8_gemms_are_the_blocks_not_the_head_or_router():
    """Fails if the FP8 share of the GEMMs counts the LM head or the router (which model/fp8.py
    leaves in bf16), or misses a block's projection."""
    cfg = _tiny(shared_expert_hidden_size=64, first_k_dense=1)
    m = cfg.model
    fp8_params = timing.fp8_gemms(m)[0]
    head, router = m.hidden_size * m.vocab_size, m.num_moe_layers * m.hidden_size * m.num_experts
    assert fp8_params == timing.active_matmul_params(m) - head - router


def test_host_adamw_step_holds_host_optimizer_seconds_of_the_shard():
    """Fails if the host optimizer is priced over the rank's whole weights rather than its
    distributed-optimizer shard, or its seconds are left out of the step, or the device AdamW
    stays in beside it."""
    cfg = _tiny()
    kw = dict(world=16, ep=4, distributed_optimizer=True)
    device = timing.step_time(cfg.model, H100, "h100", _layout(**kw), _work(), COUNTS)
    host = timing.step_time(cfg.model, H100, "h100", _layout(**kw, optimizer="host"), _work(), COUNTS)
    dense, expert = COUNTS
    shard = int(dense / 16 + expert / 4 / 4)  # dense over DP 16, the experts over EP 4 then EDP 4
    offload = host_optimizer_seconds(HostStep(shard, 4 * shard, 4 * shard), H100)
    assert host["offload_s"] == pytest.approx(offload["offload_s"])
    assert host["total_s"] - device["total_s"] == pytest.approx(offload["offload_s"] - device["optimizer_s"])
    assert device["offload_s"] == 0 and device["optimizer_s"] > 0


def test_bf16_parameters_change_the_step_bytes():
    """Fails if bf16 parameters are priced like fp32 ones: the AdamW step also rounds the fp32
    masters into the bf16 weights (and widens the gradients without the distributed optimizer),
    the forward casts no weights, and the distributed optimizer gathers bf16 weights."""
    cfg = _tiny()
    fp32 = timing.step_time(cfg.model, H100, "h100", _layout(), _work(), COUNTS)
    bf16 = timing.step_time(cfg.model, H100, "h100", _layout(param_dtype="bf16"), _work(), COUNTS)
    assert bf16["optimizer_s"] == pytest.approx(fp32["optimizer_s"] * 40 / 28)
    # the weight casts saved, one per micro-batch's forward: the compute outside the optimizer
    # shrinks by them
    saved = 4 * 6 * sum(COUNTS) / (H100.hbm_bytes_per_s * timing.HBM_EFFICIENCY)
    assert (fp32["compute_s"] - fp32["optimizer_s"]) - (bf16["compute_s"] - bf16["optimizer_s"]) == pytest.approx(saved)
    kw = dict(world=16, distributed_optimizer=True)
    gather32 = timing.step_time(cfg.model, H100, "h100", _layout(**kw), _work(), COUNTS)["comm_s"]
    gather16 = timing.step_time(cfg.model, H100, "h100", _layout(**kw, param_dtype="bf16"), _work(), COUNTS)["comm_s"]
    assert gather16 < gather32


def test_a_refused_precision_is_never_proposed(monkeypatch):
    """Fails if candidates() offers bf16 with FP8 or FP8 with TP > 1 (both refused by the
    program), or if judge() lets either through where a caller plants them."""
    every = list(layouts.candidates(4, 8))
    assert {c.precision for c in every} == set(layouts.PRECISIONS)
    assert not [c for c in every if c.fp8 and (c.param_dtype == "bf16" or c.tp > 1)]
    # Planted: the refused combinations, ranked fastest so the walk judges them first.
    planted = [_layout(world=4, ep=4, param_dtype="bf16", fp8=True), _layout(world=4, tp=2, ep=4, fp8=True)]
    monkeypatch.setattr(layouts, "candidates", lambda *a, **k: planted + [c for c in every if c.tp == 1][:40])
    real = timing.step_time

    def planted_first(model, gpu, gpu_kind, layout, work, counts):
        t = dict(real(model, gpu, gpu_kind, layout, work, counts))
        t["total_s"] /= 1000 if layout in planted else 1
        return t

    monkeypatch.setattr(timing, "step_time", planted_first)
    monkeypatch.setattr(memory, "resident", lambda *a, **k: {"parameters": MIB})
    monkeypatch.setattr(memory, "per_rank", lambda *a, **k: {"parameters": MIB})
    monkeypatch.setattr(floors, "estimate", lambda *a, **k: None)
    result = plan(_tiny(), 4, "h100", "lognormal:256,0.5,1024", 16384, top=3)
    assert len(result["fit"]) == 3
    assert not [p for p in result["fit"] if p.layout in planted]
    refused = {p.layout: p.refused for p in result["excluded"] if p.layout in planted}
    assert set(refused) == set(planted), "the planted layouts were not walked first"
    assert "bf16" in refused[planted[0]] and "parallel.tp=2" in refused[planted[1]], refused


def test_config_of_writes_the_precision_and_the_cuda_target_accepts_it():
    """Fails if config_of leaves train.param_dtype, execution.fp8 or optim.offload as the base
    had them, or if an enumerated precision is one the program refuses on an H100."""
    from longctx_moe.rehearsal.fake_world import cuda_ops
    from longctx_moe.rehearsal.gpus import as_cuda_device

    base = _tiny()
    for name, (dtype, fp8, optimizer) in layouts.PRECISIONS.items():
        layout = _layout(world=4, ep=4, param_dtype=dtype, fp8=fp8, optimizer=optimizer)
        cfg = layouts.config_of(base, layout)
        assert (cfg.train.param_dtype, cfg.execution.fp8, cfg.optim.offload) == (
            dtype, "torch" if fp8 else "none", "cpu" if optimizer == "host" else "none"), name
        assert layouts.judge(base, layout) is None, name
        with as_cuda_device(H100):
            assert cuda_ops(cfg).fp8 == ("torch" if fp8 else "none"), name
    # a base that runs FP8 in another recipe: a layout without FP8 drops the recipe too
    block = dataclasses.replace(base, execution=dataclasses.replace(base.execution, fp8="torch",
                                                                    fp8_recipe="block"))
    assert layouts.judge(block, _layout(world=4, ep=4)) is None


def test_precision_restricts_the_candidates_and_refuses_an_unknown_name():
    """Fails if --precision is accepted and then ignored, or an unknown name passes."""
    from longctx_moe.plan.cli import main

    some = {c.precision for c in layouts.candidates(4, 8, precision="fp32,bf16+host")}
    assert some == {"fp32", "bf16+host"}
    with pytest.raises(ValueError, match="not one of"):
        list(layouts.candidates(4, 8, precision="fp32,bf16+fp8"))
    assert main(["--model", "configs/tiny_cpu.yaml", "--gpus", "4", "--tokens-per-step", "16384",
                 "--precision", "fp9"]) == 2


def test_fp8_widths_the_gemms_cannot_take_are_refused():
    """Fails if judge() resolves FP8 without building the model as the trainer's start-up does
    (cuBLAS's FP8 GEMMs take widths in multiples of 16 only), so the plan would propose it."""
    base = _tiny(expert_hidden_size=120)
    assert layouts.judge(base, _layout(world=4, ep=4)) is None
    assert "multiples of 16" in layouts.judge(base, _layout(world=4, ep=4, fp8=True))


def test_selective_recompute_costs_the_experts_gate_up_gemm_again():
    """Fails if selective recompute is priced as none (the planner then ties them and ranks the
    mode that recomputes as fast), or as a full recompute, or at the bf16 rate under FP8: the
    experts' gate / up grouped GEMM forward again, 2 x tokens x top-k x d x 2F FLOPs a MoE layer."""
    cfg = _tiny(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, num_experts=8, top_k=2,
                expert_hidden_size=4096)
    m = cfg.model
    none, selective, full = (_compute(cfg, recompute=r) for r in ("none", "selective", "full"))
    tokens = _work().tokens
    gate_up = 2.0 * tokens * m.top_k * m.hidden_size * 2 * m.expert_hidden_size * m.num_moe_layers
    assert selective - none == pytest.approx(gate_up / (H100.bf16_flops * timing.GEMM_EFFICIENCY["h100"]), rel=1e-9)
    assert none < selective < full
    fp8 = _compute(cfg, recompute="selective", fp8=True) - _compute(cfg, recompute="none", fp8=True)
    assert fp8 == pytest.approx(gate_up / (H100.fp8_flops * timing.FP8_GEMM_EFFICIENCY["h100"]), rel=1e-9)
