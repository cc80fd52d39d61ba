"""Triton RoPE (kernels/triton_rope.py) against the torch path: the kernel against
apply_partial_rope (and MLA's reordering of interleaved pairs before it), the attention modules
with execution.rope=triton against the same modules on torch, and the setting's resolution.

Tolerance: none. The kernel forms the torch path's products and sums in the same order and
rounds each to the tables' dtype as torch's separate ops do (no transcendental: the tables come
in), so under the interpreter every output and gradient is bitwise the torch path's, float32
and bf16. (A GPU may contract a product and a sum into one FMA: bench/triton_kernels.py reports
that difference.) The kernel tests use random tables, whose two halves differ, so that each
product's pairing of sin with its half is checked, which the real tables (halves repeated)
would not tell apart."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx_moe.execution import ExecutionConfig, Target, resolve
from longctx_moe.kernels import triton_ops
from longctx_moe.model.attention import Attention, doc_layout
from longctx_moe.model.mla import MLAttention
from longctx_moe.model.rope import apply_partial_rope
from tests.kernels.test_kernel_setting import changed_ops
from tests.model.helpers import packed_batch, tiny_config, tiny_ops

pytestmark = pytest.mark.triton


def _torch_rope(x_THD, cos_TR, sin_TR, interleaved):
    """The model's torch path: MLA's reordering of pairs (mla.MLAttention._rope), then
    rotate-half on the first R dims."""
    if interleaved:
        t, h, _ = x_THD.shape
        r = cos_TR.shape[-1]
        rot = x_THD[..., :r].reshape(t, h, r // 2, 2).transpose(-1, -2).reshape(t, h, r)
        x_THD = torch.cat([rot, x_THD[..., r:]], dim=-1)
    return apply_partial_rope(x_THD, cos_TR, sin_TR)


def _operands(t, h, g, d, r, dtype, seed=0):
    """q a strided view (heads of a wider projection, as MLA's rope part), k contiguous, random
    tables [T, R]."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, h, d + 3, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(t, g, d, generator=gen).to(dtype).requires_grad_()
    cos, sin = (torch.randn(t, r, generator=gen).to(dtype) for _ in range(2))
    return wide, wide[..., 3:], k, cos, sin


CASES = {"rotate_half": (4, 2, 24, 24, False),  # (H, G, D, R, interleaved): D not a power of two
         "partial": (3, 1, 40, 20, False),  # GLM-4.5's partial rotary: D - R pass through
         "mla_interleaved": (4, 1, 12, 12, True),  # DeepSeek-V3: one k head, pairs reordered
         "interleaved_partial": (2, 2, 10, 6, True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("t", [1, 19])
def test_rope_matches_the_torch_path(case, dtype, t):
    h, g, d, r, interleaved = CASES[case]
    wide, q, k, cos, sin = _operands(t, h, g, d, r, dtype, seed=t)
    gen = torch.Generator().manual_seed(99)
    dq, dk = (torch.randn(t, n, d, generator=gen).to(dtype) for n in (h, g))
    got = triton_ops().rope(q, k, cos, sin, interleaved)
    ref = (_torch_rope(q, cos, sin, interleaved), _torch_rope(k, cos, sin, interleaved))
    got_grads = torch.autograd.grad(got, (wide, k), (dq, dk))
    ref_grads = torch.autograd.grad(ref, (wide, k), (dq, dk))
    for a, b in zip((*got, *got_grads), (*ref, *ref_grads), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[0].is_contiguous() and got[1].is_contiguous()


def test_an_output_without_gradient():
    """Only q reaches the loss: k's gradient is zero, q's as the torch path's."""
    wide, q, k, cos, sin = _operands(7, 2, 2, 16, 16, torch.float32)
    q_out, _ = triton_ops().rope(q, k, cos, sin)
    dwide, dk = torch.autograd.grad(q_out.sum(), (wide, k))
    (ref,) = torch.autograd.grad(_torch_rope(q, cos, sin, False).sum(), (wide,))
    assert torch.equal(dwide, ref) and not dk.any()


def test_refuses_tables_of_another_dtype():
    _, q, k, cos, sin = _operands(5, 2, 2, 8, 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"must have q's dtype \(torch.bfloat16\)"):
        triton_ops().rope(q, k, cos.float(), sin.float())


def _module_run(cls, cfg, impl, batch):
    torch.manual_seed(0)
    attn = cls(cfg, 0, tiny_ops(rope=impl))
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layout = doc_layout(batch)
    x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    y = attn(x, layout)
    return (y.detach(), *torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(),
                                             [x, *attn.parameters()]))


MODULES = {
    "gqa_qk_norm": (Attention, dict(qk_norm=True)),
    "partial_rotary": (Attention, dict(head_dim=12, partial_rotary_factor=0.5)),
    "mla_interleaved": (MLAttention, dict(attention_type="mla", q_lora_rank=10, kv_lora_rank=12,
                                          qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                                          qk_norm=False, rope_interleave=True)),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_attention_under_triton_equals_the_torch_path(name, launches):
    """Packed documents of 1, 6, 1 and 5 tokens (positions restart at each), padding between:
    output and every gradient bitwise the torch path's (see the module docstring)."""
    cls, overrides = MODULES[name]
    cfg = tiny_config(**overrides)
    batch = packed_batch([1, 6, 1, 5], vocab=cfg.vocab_size, pad_multiple=2,
                         generator=torch.Generator().manual_seed(2))
    got = _module_run(cls, cfg, "triton", batch)
    rope_launches = [k.fn.__name__ for k in launches if k.fn.__module__.endswith("triton_rope")]
    assert rope_launches == ["_rope_kernel"] * 2  # q and k together, forward and backward
    ref = _module_run(cls, cfg, "torch", batch)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


CUDA = Target("cuda", torch.bfloat16, torch.float32)


def test_resolution_picks_triton_on_cuda_and_one_setting_switches_it(monkeypatch):
    ops = resolve(ExecutionConfig(), CUDA)
    assert ops.rope == "triton" and "CUDA" in dict(ops.reasons)["rope"]
    off = resolve(ExecutionConfig(rope="torch"), CUDA)
    assert changed_ops(ops, off) == {"rope"} and off.rope == "torch"
    compiled = resolve(ExecutionConfig(), dataclasses.replace(CUDA, compile=True))
    assert compiled.rope == "torch" and "train.compile" in dict(compiled.reasons)["rope"]
    assert resolve(ExecutionConfig(), Target("cpu")).rope == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="execution.rope=triton: .*use execution.rope=auto or torch") as e:
        resolve(ExecutionConfig(rope="triton"), Target("cpu"))
    assert "\n" not in str(e.value)
