"""Triton SwiGLU (kernels/triton_swiglu.py) against the torch path: the activation's kernels
against _SwiGLUDown's ops, the experts and the dense MLP with execution.swiglu=triton against
the same modules on torch, and the setting's resolution.

Tolerances. The kernels do the torch path's float32 arithmetic (float64 for float64) and round
where torch writes a tensor, so they differ only through exp: numpy's expf under the interpreter
against aten's, each within an ulp or two of float32. Through silu and its backward (a handful
of float32 operations) that stays within 2^-20 of each value in float32 and 1e-13 in float64.
In bf16 those float32 values are rounded to bf16: they round alike except where the two float32
values straddle a rounding boundary, which an ulp-sized difference reaches for about 2^-15 of
the values; then one bf16 step (2^-8 relative) apart. So bf16: every value within one step, and
at most 1 in 1000 not equal (a missing or extra rounding step changes a large share of them)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from longctx_moe.execution import ExecutionConfig, Target, resolve
from longctx_moe.kernels import triton_ops
from longctx_moe.model.experts import GroupedExperts, _activation, _silu_and_act
from longctx_moe.model.layers import SwiGLU
from tests.kernels.test_cpu_swiglu import _torch_backward
from tests.kernels.test_kernel_setting import changed_ops
from tests.model.helpers import tiny_config, tiny_ops

pytestmark = pytest.mark.triton

# One bf16 step (ulp) of a value v is 2^-7 of the power of two below |v|: at most 2^-7 |v| (2^-8
# |v| is less than one step for values just above a power of two).
BF16_STEP = 2.0 ** -7
BF16_UNEQUAL = 1e-3
CLOSE = {torch.float32: dict(rtol=2.0 ** -20, atol=1e-6), torch.float64: dict(rtol=1e-13, atol=1e-13)}


def _assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype != torch.bfloat16:
        torch.testing.assert_close(got, ref, **CLOSE[ref.dtype])
        return
    diff = (got.double() - ref.double()).abs()
    assert bool((diff <= BF16_STEP * ref.double().abs()).all()), float(diff.max())
    assert float((diff > 0).double().mean()) <= BF16_UNEQUAL


def _rows(n: int, f: int, dtype, seed: int = 0):
    """h = [gate | up] of n rows (scale 4: silu's curved part and its tails) and dact."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, 2 * f, generator=g) * 4).to(dtype)
    return h, torch.randn(n, f, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n,f", [(37, 7), (1, 100), (20, 300)])
def test_kernels_match_the_experts_torch_path(n, f, dtype):
    """[gate | up] halves of one buffer (row stride 2F); widths below, at odd sizes past and
    across one column tile (256), a single row."""
    h, dact = _rows(n, f, dtype, seed=f)
    gate, up = h.chunk(2, dim=-1)
    act = triton_ops().swiglu_fwd(gate, up)
    act_again, dh = triton_ops().swiglu_bwd(gate, up, dact)
    ref_act, ref_dh = _torch_backward(h, dact)
    assert torch.equal(_silu_and_act(h)[1], ref_act)
    for got, ref in ((act, ref_act), (act_again, ref_act), (dh, ref_dh)):
        _assert_matches(got, ref)


def test_separate_operands_and_a_strided_gradient():
    """The dense MLP's layout: gate and up their own tensors, dact a column slice of a wider one."""
    h, _ = _rows(29, 48, torch.bfloat16, seed=3)
    gate, up = h[:, :48].clone(), h[:, 48:].clone()
    dact = torch.randn(29, 60, generator=torch.Generator().manual_seed(4)).bfloat16()[:, 5:53]
    act, dh = triton_ops().swiglu_bwd(gate, up, dact)
    ref_act, ref_dh = _torch_backward(h, dact)
    _assert_matches(act, ref_act)
    _assert_matches(dh, ref_dh)


def test_differentiable_entry_point_gradients():
    h, dact = _rows(13, 40, torch.float32, seed=5)
    gate, up = (t.clone().requires_grad_() for t in h.chunk(2, dim=-1))
    act = triton_ops().swiglu(gate, up)
    got = torch.autograd.grad(act, (gate, up), dact)
    ref = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), dact)
    for a, b in zip(got, ref, strict=True):
        _assert_matches(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_clamped_form_matches_gpt_oss_activation(dtype):
    """model.expert_activation=clamped_swiglu: scale 6 puts a share of gate above the limit 7 and
    of up outside [-7, 7] (the clamps pass no gradient there); F = 300 spans two column tiles."""
    h, dact = _rows(21, 300, dtype, seed=7)
    h = h * 1.5
    got_in = [t.clone().requires_grad_() for t in h.chunk(2, dim=-1)]
    ref_in = [t.clone().requires_grad_() for t in h.chunk(2, dim=-1)]
    assert bool((ref_in[0] > 7).any() and (ref_in[1].abs() > 7).any())
    got = triton_ops().swiglu(*got_in, 7.0)
    ref = _activation(*ref_in, "clamped_swiglu", 7.0)
    _assert_matches(got.detach(), ref.detach())
    for a, b in zip(torch.autograd.grad(got, got_in, dact), torch.autograd.grad(ref, ref_in, dact), strict=True):
        _assert_matches(a, b)


def test_refuses_mismatched_operands():
    h, _ = _rows(4, 8, torch.float32)
    with pytest.raises(ValueError, match="must match in shape and dtype"):
        triton_ops().swiglu_fwd(h[:, :8], h[:, 8:].bfloat16())


def _experts_run(ops, dtype, bias=False, activation="swiglu"):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 40, bias, activation, ops=ops)  # F = 40: masked lanes in a tile
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cnt = torch.tensor([9, 0, 1, 27])  # an idle expert and a one-row one
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    g = torch.randn(37, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    with mock.patch("longctx_moe.model.grouped_gemm.wants_padding", return_value=False):
        y = experts(x, cnt)
        return (y.detach(), *torch.autograd.grad(y, [x, *experts.parameters()], g))


@pytest.mark.parametrize("dtype,bias,activation", [
    (torch.float32, False, "swiglu"), (torch.bfloat16, False, "swiglu"),
    (torch.bfloat16, True, "swiglu"), (torch.bfloat16, True, "clamped_swiglu")],
    ids=["fp32", "bf16", "bf16_bias", "bf16_gpt_oss"])
def test_experts_under_triton_equal_the_torch_path(dtype, bias, activation, launches):
    """The same GEMMs around the activation: output and every gradient as the torch path's;
    with biases (model.expert_proj_bias) through plain autograd around the activation, and
    gpt-oss's clamped form. In bf16 an activation value one step off moves a GEMM output by at
    most a step times its weight's share: within 2^-7 of each tensor's largest value."""
    got = _experts_run(tiny_ops(swiglu="triton"), dtype, bias, activation)
    assert _swiglu_launches(launches) == ["_fwd_kernel", "_bwd_kernel"]
    ref = _experts_run(tiny_ops(swiglu="torch"), dtype, bias, activation)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype
        scale = float(b.double().abs().max())
        tol = 2.0 ** -7 * scale if dtype == torch.bfloat16 else 1e-5 * scale
        assert float((a.double() - b.double()).abs().max()) <= tol
    assert got[-1][1].abs().max() == 0  # the idle expert's down projection gets no gradient


def _swiglu_launches(launches) -> list[str]:
    return [k.fn.__name__ for k in launches if k.fn.__module__.endswith("triton_swiglu")]


def test_dense_mlp_under_triton_equals_the_torch_path(launches):
    """fp32 weights under bf16 autocast (the trainer's mode); tolerances as the experts'."""
    torch.manual_seed(0)
    mlps = {impl: SwiGLU(32, 72, impl) for impl in ("torch", "triton")}
    mlps["triton"].load_state_dict(mlps["torch"].state_dict())
    x = torch.randn(23, 32).requires_grad_()
    g = torch.randn(23, 32).bfloat16()
    res = {}
    for impl, mlp in mlps.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(x)
        res[impl] = (y.detach(), *torch.autograd.grad(y, [x, *mlp.parameters()], g))
    assert _swiglu_launches(launches) == ["_fwd_kernel", "_bwd_kernel"]  # the triton MLP's, once each
    for a, b in zip(res["triton"], res["torch"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert float((a.double() - b.double()).abs().max()) <= 2.0 ** -7 * float(b.double().abs().max())


def test_model_modules_take_the_setting():
    from longctx_moe.model import build_model

    cfg = tiny_config(first_k_dense=1, shared_expert_hidden_size=8)
    model = build_model(cfg, tiny_ops(swiglu="triton"))
    assert model.layers[0].ffn.triton and model.layers[1].ffn.shared.triton
    assert model.layers[1].ffn.experts.swiglu_impl == "triton"
    model = build_model(cfg, tiny_ops(swiglu="torch"))
    assert not model.layers[0].ffn.triton and model.layers[1].ffn.experts.swiglu_impl == "torch"


CUDA = Target("cuda", torch.bfloat16, torch.float32)


def test_resolution_picks_triton_on_cuda_and_one_setting_switches_it(monkeypatch):
    ops = resolve(ExecutionConfig(), CUDA)
    assert ops.swiglu == "triton" and "CUDA" in dict(ops.reasons)["swiglu"]
    off = resolve(ExecutionConfig(swiglu="torch"), CUDA)
    assert changed_ops(ops, off) == {"swiglu"} and off.swiglu == "torch"
    assert resolve(ExecutionConfig(), Target("cpu")).swiglu != "triton"  # CPUs: the C++ kernel or torch
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="execution.swiglu=triton: .*TRITON_INTERPRET=1.*use execution.swiglu=auto or torch") as e:
        resolve(ExecutionConfig(swiglu="triton"), Target("cpu"))
    assert "\n" not in str(e.value)
