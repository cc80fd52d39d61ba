"""Activation recompute (train.recompute): gradients equal the run without it, and a recomputed
block sends every token to the experts the forward chose.

float64: recompute re-runs the same operations on the same inputs, so the gradients are equal up
to the order of accumulation (measured bitwise here); 1e-12 is far below any real difference.
"""

from __future__ import annotations

import pytest
import torch

from longctx_moe.model import build_model
from longctx_moe.model.config import BalanceConfig
from tests.model.helpers import packed_batch, tiny_config, tiny_ops

TOL = 1e-12


def _model(mode, **overrides):
    torch.manual_seed(0)
    cfg = tiny_config(first_k_dense=1, num_layers=3, shared_expert_hidden_size=8, expert_bias=True,
                      **overrides)
    balance = BalanceConfig(aux_loss_type="seq", aux_loss_coeff=0.1, z_loss_coeff=0.01)
    return build_model(cfg, tiny_ops(mode), balance).double()


def _grads(mode):
    model = _model(mode)
    batch = packed_batch([1, 13, 5, 30], 64, pad_multiple=4, generator=torch.Generator().manual_seed(1))
    out = model(batch)
    (out.ce_sum / batch.num_target_tokens() + out.aux_loss + out.z_loss).backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gradients_equal_the_plain_run(mode):
    ref_out, ref = _grads("none")
    out, got = _grads(mode)
    assert abs(float(out.ce_sum.detach()) - float(ref_out.ce_sum.detach())) < TOL
    assert torch.equal(out.expert_counts, ref_out.expert_counts)
    for name, g in ref.items():
        assert (got[name] - g).abs().max() < TOL, name


def test_full_recompute_replays_the_forward_routes():
    """The router is inverted between forward and backward: a recomputation that routed afresh
    would send tokens to other experts, and other experts would get gradients than in the plain
    run."""
    batch = packed_batch([5], 64, generator=torch.Generator().manual_seed(2))
    grads = {}
    for mode in ("none", "full"):
        model = _model(mode, num_experts=8, top_k=1)  # 5 tokens reach at most 5 of 8 experts
        out = model(batch)
        if mode == "full":
            with torch.no_grad():
                for layer in model.moe_layers():
                    layer.router.weight.neg_()
        out.ce_sum.backward()
        grads[mode] = [layer.experts.w_down.grad.abs().sum((1, 2)) > 0 for layer in model.moe_layers()]
    assert not all(g.all() for g in grads["none"])  # some experts get nothing: a change would show
    for plain, recomputed in zip(grads["none"], grads["full"], strict=True):
        assert torch.equal(plain, recomputed)


def test_unknown_mode_is_refused_in_one_line():
    with pytest.raises(ValueError, match="train.recompute='some' is not allowed"):
        _model("some")


def _first_forward_of_the_process(rank, world):
    from longctx_moe.model.grouped_gemm import grouped_mm_works

    # The launcher's ranks fork from a server that only imported modules: nothing probed yet.
    assert grouped_mm_works.cache_info().currsize == 0
    ops = tiny_ops("selective", torch.bfloat16)  # the start-up resolution probes torch._grouped_mm
    probed = grouped_mm_works.cache_info().currsize
    torch.manual_seed(0)
    m = build_model(tiny_config(hidden_size=64, head_dim=16, expert_hidden_size=64), ops)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(packed_batch([200], 64))
    out.ce_sum.backward()
    return probed, grouped_mm_works.cache_info().currsize


@pytest.mark.slow
def test_selective_recompute_in_bf16_autocast_from_a_fresh_process():
    """torch._grouped_mm is probed (forward and backward) when the run's ops are resolved, before
    any model exists, never inside the experts' recompute region (whose recomputation would then
    save other tensors than its forward did, and the backward fail): the first forward of a fresh
    process probes nothing more and its selective recompute runs."""
    from tests.launcher import run_distributed

    assert run_distributed(_first_forward_of_the_process, 1, timeout=300) == [(1, 1)]


def test_full_recompute_runs_the_router_on_a_path_that_replays_as_it_forwarded():
    """Full recompute replays the forward's routes in the recomputation; the Triton router's
    forward saves other tensors than its replay path (the kernel's outputs against a gather of the
    given experts' weights), so checkpointing's recomputation would not match and the backward
    fail: the router resolves to torch, and naming the Triton router is refused in one line."""
    from longctx_moe.execution import ExecutionConfig, Target, resolve

    ops = tiny_ops("full", kernels="triton")
    assert ops.router == "torch" and "recompute=full" in dict(ops.reasons)["router"]
    assert tiny_ops("none", kernels="triton").router == "triton"  # the path a plain run takes
    torch.manual_seed(0)
    model = build_model(tiny_config(num_layers=2), ops)
    batch = packed_batch([7, 20], 64, generator=torch.Generator().manual_seed(1))
    model(batch).ce_sum.backward()  # CheckpointError with the Triton router
    assert model.moe_layers()[0].router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="execution.router=triton .* train.recompute=full"):
        resolve(ExecutionConfig(router="triton"), Target("cpu"), "full")
