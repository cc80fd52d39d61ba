"""Float64 checks of the building blocks against naive references: RMSNorm, RoPE, attention over
packed documents (through the cp_attention kernel), grouped GEMM, and the local dispatcher."""

import dataclasses
from unittest import mock

import pytest
import torch

from cp_attention.hardware import cpu_has_avx512_bf16
from longctx_moe.execution import torch_ops
from longctx_moe.kernels import cpu_swiglu
from longctx_moe.model.attention import Attention, doc_layout
from longctx_moe.model.experts import GroupedExperts
from longctx_moe.model.grouped_gemm import (
    grouped_matmul,
    grouped_mm_works,
    padded_size,
    resolve_impl,
)
from longctx_moe.model.layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin
from longctx_moe.model.moe import LocalDispatcher
from tests.model.helpers import dense_attention, packed_batch, tiny_config

# float64 throughout: differences are pure rounding (~1e-15 relative); 1e-10 leaves ample margin.
TOL64 = 1e-10


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 16, dtype=torch.float64)
    ref = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), ref, atol=TOL64, rtol=0)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_rmsnorm_backward_matches_autograd_of_the_formula():
    """The hand-written backward (it keeps x and one scale per row) against autograd through the
    formula, float64, on [2, 3, 16] inputs (leading dims as q/k norms see them)."""
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 16, dtype=torch.float64)
    dx, dw = torch.autograd.grad((norm(x) * g).sum(), (x, norm.weight))
    x2 = x.detach().clone().requires_grad_()
    w2 = norm.weight.detach().clone().requires_grad_()
    ref = w2 * x2 / torch.sqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6)
    rdx, rdw = torch.autograd.grad((ref * g).sum(), (x2, w2))
    torch.testing.assert_close(dx, rdx, atol=TOL64, rtol=0)
    torch.testing.assert_close(dw, rdw, atol=TOL64, rtol=0)
    assert torch.autograd.gradcheck(lambda t: norm(t), (x[:1, :1],))


def test_rmsnorm_saves_input_and_row_scale_only():
    """bf16 input (a q/k norm under autocast): the backward keeps the bf16 input and an fp32
    scale per row, no fp32 copy of the input nor the normalised tensor."""
    norm = RMSNorm(64)
    x = torch.randn(128, 64).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16, [(t.shape, t.dtype) for t in saved]
    assert sum(t.numel() for t in saved if t.numel() < x.numel()) == 128 + 64  # scale + weight


def test_rope_matches_pairwise_rotation_and_restarts():
    torch.manual_seed(0)
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 0, 7, 1000])
    cos, sin = rope_cos_sin(pos, 8, 10000.0)
    # The angles are fp32 on purpose (HF parity); they agree with float64 to fp32 rounding of
    # angles up to 1000 rad (~1000 * 6e-8).
    inv64 = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    ang64 = pos.double()[:, None] * inv64
    torch.testing.assert_close(cos[:, :4].double(), ang64.cos(), atol=2e-4, rtol=0)
    x = torch.randn(9, 3, 8, dtype=torch.float64)
    y = apply_rope(x, cos.double(), sin.double())
    ang = (pos.float()[:, None] * inv64.float())[:, None, :]  # the same fp32 angles and cos/sin
    c, s = ang.cos().double(), ang.sin().double()
    x1, x2 = x[..., :4], x[..., 4:]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    torch.testing.assert_close(y, ref, atol=TOL64, rtol=0)
    # Restarting positions: a token at position 0 is left unrotated wherever it sits in the row.
    torch.testing.assert_close(y[[0, 4, 6]], x[[0, 4, 6]], atol=0, rtol=0)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_through_kernel_matches_dense_reference(qk_norm):
    """Documents of length 1, padded slots and trailing padding; forward and backward."""
    torch.manual_seed(0)
    cfg = tiny_config(qk_norm=qk_norm)
    attn = Attention(cfg).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    batch = packed_batch([1, 6, 3, 1, 9], cfg.vocab_size, pad_multiple=4, trailing_pad=5)
    layout = doc_layout(batch)
    # Padding runs are their own segments: [0,1) pad [1,4) ... checks the documented choice.
    assert layout.cu_attn_S.tolist() == [0, 1, 4, 10, 12, 15, 16, 17, 20, 29, 32, 37]
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    out = attn(x, layout)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *attn.parameters()], g)
    dense = dataclasses.replace(layout, attend=lambda q, k, v, backend: dense_attention(q, k, v, layout.cu_attn_S))
    ref = attn(x, dense)
    ref_grads = torch.autograd.grad(ref, [x, *attn.parameters()], g)
    torch.testing.assert_close(out, ref, atol=TOL64, rtol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=TOL64, rtol=0)


def _loop_reference(x_MD, w_EDF, counts):
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x_MD[start:start + n] @ w_EDF[e])
        start += n
    return torch.cat(out)


@pytest.mark.skipif(not grouped_mm_works("cpu", torch.float32), reason="torch._grouped_mm missing")
def test_grouped_mm_matches_loop_with_empty_experts():
    torch.manual_seed(0)
    counts = [5, 0, 9, 0, 2, 0]  # experts with no tokens, the last one included
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w = torch.randn(6, 16, 24, requires_grad=True)
    cnt = torch.tensor(counts)
    assert resolve_impl("auto", x, w) == "grouped_mm"
    y = grouped_matmul(x, w, cnt, "grouped_mm")
    y.sum().backward()  # an expanded grad_output: the contiguous-grad guard must handle it
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = _loop_reference(x, w, counts)
    ref.sum().backward()
    # fp32 on both sides; the same products summed in possibly different order: K=16 terms of
    # O(1) values give ~1e-6 absolute differences at most.
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-5)
    assert gw[1].abs().max() == 0 and gw[5].abs().max() == 0


def test_group_ends_are_formed_once_per_counts_tensor():
    """A layer's grouped GEMMs share one counts tensor: its ends are formed once; an in-place
    change of the counts (its version moves) forms them again, so a stale offset never runs."""
    from longctx_moe.model.grouped_gemm import _group_ends

    torch.manual_seed(0)
    cnt = torch.tensor([5, 0, 9])
    first = _group_ends(cnt)
    assert _group_ends(cnt) is first and first.tolist() == [5, 5, 14]
    cnt[1] = 2
    assert _group_ends(cnt).tolist() == [5, 7, 16]
    x, w = torch.randn(16, 16), torch.randn(3, 16, 8)  # 16-byte rows, as _grouped_mm takes them
    torch.testing.assert_close(grouped_matmul(x, w, cnt, "grouped_mm")[5:7], x[5:7] @ w[1], atol=1e-5, rtol=1e-5)


def test_loop_fallback_float64_and_bad_impl():
    x = torch.randn(7, 4, dtype=torch.float64)
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    cnt = torch.tensor([0, 7, 0])
    assert resolve_impl("auto", x, w) == "loop"
    torch.testing.assert_close(grouped_matmul(x, w, cnt), x @ w[1], atol=TOL64, rtol=0)
    with pytest.raises(ValueError, match="grouped_gemm='auto'"):
        grouped_matmul(x, w, cnt, "grouped_mm")
    with pytest.raises(ValueError, match="is not allowed; choose one of"):
        grouped_matmul(x, w, cnt, "cutlass")


def _naive_moe(x_TD, idx_TK, w_TK, experts):
    """Token by token, expert by expert: y_t = sum_k w_tk * SwiGLU_{e_tk}(x_t)."""
    f = experts.w_down.shape[1]
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            h = x_TD[t] @ experts.w_gate_up[e].flatten(1)
            acc = acc + w_TK[t, k] * ((torch.nn.functional.silu(h[:f]) * h[f:]) @ experts.w_down[e])
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_local_dispatcher_matches_naive(top_k):
    """top-k = E included; expert 3 receives no token; forward and backward in float64."""
    torch.manual_seed(top_k)
    experts = GroupedExperts(4, 8, 6).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    t = 11
    allowed = 4 if top_k == 4 else 3
    idx = torch.stack([torch.randperm(allowed)[:top_k] for _ in range(t)])
    x = torch.randn(t, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(t, top_k, dtype=torch.float64, requires_grad=True)
    y = LocalDispatcher()(x, idx, w, experts)
    g = torch.randn_like(y)
    params = [x, w, *experts.parameters()]
    grads = torch.autograd.grad(y, params, g)
    ref = _naive_moe(x, idx, w, experts)
    ref_grads = torch.autograd.grad(ref, params, g)
    torch.testing.assert_close(y, ref, atol=TOL64, rtol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=TOL64, rtol=0)
    if top_k < 4:
        assert grads[2][3].abs().max() == 0  # the idle expert gets an exactly zero gradient


def test_expert_precision_under_autocast():
    experts = GroupedExperts(2, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(5, 16).bfloat16()
    cnt = torch.tensor([2, 3])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtypes = {}
        for precision in ("autocast", "param", "auto"):
            experts.precision = precision
            dtypes[precision] = experts(x, cnt).dtype
    assert dtypes == {"autocast": torch.bfloat16, "param": torch.float32, "auto": torch.bfloat16}


def test_padded_size_grid():
    assert [padded_size(n) for n in (0, 1, 16, 17, 127, 128, 129, 300, 1000, 4096)] == \
        [0, 16, 16, 32, 128, 128, 144, 320, 1024, 4096]
    for n in range(1, 5000):
        p = padded_size(n)
        assert 0 <= p - n < max(16, n / 8) and p % 16 == 0  # at most 1/8 (or 15 rows) of padding
    # few distinct sizes: the point of padding is that GEMM shapes repeat
    assert len({padded_size(n) for n in range(1, 4097)}) <= 60


def test_padded_groups_match_unpadded_in_bf16():
    """Padding rows per expert (bf16 on CPU) changes neither outputs nor gradients: each row's
    GEMMs see the same operands, padding rows are zeros and get no gradient."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    cnt = torch.tensor([0, 37, 5, 22])
    x = torch.randn(64, 32).bfloat16().requires_grad_()
    g = torch.randn(64, 32).bfloat16()
    outs = []
    for pad in (True, False):
        with mock.patch("longctx_moe.model.grouped_gemm.wants_padding", return_value=pad):
            y = experts(x, cnt)
            grads = torch.autograd.grad(y, [x, *experts.parameters()], g)
        outs.append((y, *grads))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _plain_swiglu_down(experts, x_MD, counts_E):
    """The experts' SwiGLU as three autograd ops (what _SwiGLUDown replaces)."""
    cdtype = x_MD.dtype
    h = grouped_matmul(x_MD, experts.w_gate_up.flatten(2).to(cdtype), counts_E, experts.impl)
    gate, up = h.chunk(2, dim=-1)
    return grouped_matmul(torch.nn.functional.silu(gate) * up, experts.w_down.to(cdtype), counts_E,
                          experts.impl)


@pytest.mark.parametrize("dtype,fused", [(torch.float64, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_swiglu_down_is_bitwise_the_plain_composition(dtype, fused):
    """The hand-written backward forms the products autograd forms (same kernels, same order):
    outputs and every gradient bitwise equal, float64 (loop GEMMs) and bf16 (`_grouped_mm` where
    torch has it), with an expert that gets no rows. `fused`: the activation in the C++ kernel
    (kernels/cpu_swiglu.py, where the CPU builds it), whose roundings are the torch path's."""
    if fused:
        assert cpu_swiglu.available() or not cpu_has_avx512_bf16()  # built wherever it can be
    _check_swiglu_down_bitwise(dtype, torch_ops(swiglu="cpp" if fused else "torch"))


def _check_swiglu_down_bitwise(dtype, ops):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 64, ops=ops)  # F = 64: aten's bf16 silu takes its vector path on whole rows
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if dtype == torch.float64:
        experts.double()
    cnt = torch.tensor([9, 0, 30, 25])
    x = torch.randn(64, 32, dtype=dtype, requires_grad=True)
    g = torch.randn(64, 32, dtype=dtype)
    params = [x, *experts.parameters()]
    with mock.patch("longctx_moe.model.grouped_gemm.wants_padding", return_value=False):
        y = experts(x, cnt)
        grads = torch.autograd.grad(y, params, g)
        ref = _plain_swiglu_down(experts, x, cnt)
        ref_grads = torch.autograd.grad(ref, params, g)
    for a, b in zip((y, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert grads[-1][1].abs().max() == 0 and grads[-2][1].abs().max() == 0  # the idle expert


def test_experts_keep_only_their_input_and_the_gate_up_rows():
    """Per routed row the backward keeps x [D] and h = [gate | up] [2F]; not silu(gate) nor the
    activation [F] each (the weights' bf16 casts and the counts are the rest)."""
    experts = GroupedExperts(2, 32, 48)
    cnt = torch.tensor([40, 24])
    x = torch.randn(64, 32).bfloat16().requires_grad_()
    storages = {}
    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with mock.patch("longctx_moe.model.grouped_gemm.wants_padding", return_value=False), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x, cnt)
    weights = sum(p.numel() for p in experts.parameters()) * 2  # their bf16 copies
    rows = 64 * (32 + 2 * 48) * 2
    assert sum(storages.values()) <= rows + weights + cnt.numel() * 8 + 64, sorted(storages.values())


def _plain_dense_swiglu(mlp, x):
    return mlp.w_down(torch.nn.functional.silu(mlp.w_gate(x)) * mlp.w_up(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dense_swiglu_is_bitwise_the_plain_composition(dtype):
    """The dense MLP's hand-written backward forms the products autograd's linear, mul and silu
    backward form: output and every gradient bitwise equal, float64 and fp32 weights under bf16
    autocast (the trainer's mode, where the weight's gradient passes the autocast-style cast)."""
    torch.manual_seed(0)
    mlp = SwiGLU(32, 48)
    if dtype == torch.float64:
        mlp.double()
    x = torch.randn(40, 32, dtype=torch.float64 if dtype == torch.float64 else torch.bfloat16,
                    requires_grad=True)
    g = torch.randn(40, 32, dtype=x.dtype)
    params = [x, *mlp.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y, ref = mlp(x), _plain_dense_swiglu(mlp, x)
    assert y.dtype == ref.dtype == x.dtype
    grads = torch.autograd.grad(y, params, g)
    ref_grads = torch.autograd.grad(ref, params, g)
    for a, b in zip((y, *grads), (ref, *ref_grads), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_dense_swiglu_keeps_its_input_gate_and_up():
    """Per token the backward keeps x [D] (shared by the gate and up projections), gate and up
    [F] each, not silu(gate) nor the activation; the rest is the three weights' bf16 casts."""
    mlp = SwiGLU(32, 48)
    x = torch.randn(64, 32).bfloat16().requires_grad_()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    weights = sum(p.numel() for p in mlp.parameters()) * 2
    rows = 64 * (32 + 2 * 48) * 2
    assert sum(storages.values()) <= rows + weights, sorted(storages.values())
