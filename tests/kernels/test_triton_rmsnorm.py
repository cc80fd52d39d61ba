"""Triton RMSNorm and residual add + RMSNorm against layers.RMSNorm's torch path.

Tolerances: both normalise in fp32 from the same inputs; the mean of squares is a sum of D terms
in another order, and rsqrt is 1/sqrt under the interpreter, so the scale per row may differ by
an ulp or two: 1e-6 relative on outputs and on dx. dw sums N <= 50 products of O(1) over the
rows in another order (per-program partial sums), whose rounding errors add up to N ulps of the
largest partial sum (~4e-6 measured where terms cancel): 5e-6 absolute. bf16 outputs are those fp32
values rounded to bf16 (both round to nearest even), so they may differ by one bf16 step where
the fp32 values straddle a rounding boundary: 1e-2 relative."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx_moe.model.layers import RMSNorm

pytestmark = pytest.mark.triton

FP32 = dict(rtol=1e-6, atol=1e-6)
DW32 = dict(rtol=1e-6, atol=5e-6)
BF16 = dict(rtol=1e-2, atol=1e-2)


def _norms(d: int, dtype=torch.float32):
    out = {}
    for kernels in ("torch", "triton"):
        norm = RMSNorm(d, 1e-6, kernels).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, d))
        out[kernels] = norm
    return out


def _grads(outputs, inputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("shape", [(37, 100), (5, 3, 32)])
def test_rmsnorm_matches_torch_fp32(shape):
    """D=100 (not a power of two: masked lanes) and a [T, H, R] input as the q/k norms see."""
    norms = _norms(shape[-1])
    x = torch.randn(shape, requires_grad=True)
    res = {}
    for kernels, norm in norms.items():
        y = norm(x)
        res[kernels] = (y, *_grads([y], (x, norm.weight)))
    for i, (a, b) in enumerate(zip(res["triton"], res["torch"], strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **(DW32 if i == 2 else FP32))


def test_rmsnorm_bf16_autocast_output_within_bound():
    norms = _norms(64)
    x = torch.randn(50, 64, requires_grad=True)
    res = {}
    for kernels, norm in norms.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x)  # fp32 input under autocast: the output is the matmuls' bf16
        res[kernels] = (y, *_grads([y], (x, norm.weight)))
    assert res["triton"][0].dtype == torch.bfloat16
    for a, b in zip(res["triton"], res["torch"], strict=True):
        torch.testing.assert_close(a, b, **BF16)


@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_matches_add_then_norm(res_dtype):
    """x fp32 (the residual stream) + a branch output in fp32 or bf16 (under autocast)."""
    norms = _norms(96)
    x = torch.randn(41, 96, requires_grad=True)
    r = torch.randn(41, 96).to(res_dtype).requires_grad_()
    res = {}
    for kernels, norm in norms.items():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=res_dtype == torch.bfloat16):
            s, y = norm(x, residual=r)
        res[kernels] = (s, y, *_grads([s, y], (x, r, norm.weight)))
    for i, (a, b) in enumerate(zip(res["triton"], res["torch"], strict=True)):
        assert a.dtype == b.dtype
        tol = (DW32 if i == 4 else FP32) if res_dtype == torch.float32 else BF16
        torch.testing.assert_close(a, b, **tol)
    # The sum itself is one fp32 add in both paths.
    assert torch.equal(res["triton"][0], res["torch"][0])


def test_add_rmsnorm_bf16_sum_is_rounded_before_the_norm():
    """bf16 + bf16: torch rounds the sum to bf16 and normalises the rounded sum."""
    norms = _norms(64, torch.bfloat16)
    x = torch.randn(33, 64).to(torch.bfloat16).requires_grad_()
    r = torch.randn(33, 64).to(torch.bfloat16).requires_grad_()
    res = {}
    for kernels, norm in norms.items():
        s, y = norm(x, residual=r)
        res[kernels] = (s, y, *_grads([s, y], (x, r, norm.weight)))
    assert torch.equal(res["triton"][0], res["torch"][0])
    for a, b in zip(res["triton"][1:], res["torch"][1:], strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, **BF16)


def test_rmsnorm_backward_with_several_tiles_per_program(monkeypatch):
    """Long inputs have more row tiles than backward programs: each program loops over tiles."""
    from longctx_moe.kernels import triton_rmsnorm

    monkeypatch.setattr(triton_rmsnorm, "_MAX_PROGS", 2)
    norms = _norms(1024)  # 4 rows per tile: 23 rows are 6 tiles, 3 per program
    x = torch.randn(23, 1024, requires_grad=True)
    res = {}
    for kernels, norm in norms.items():
        y = norm(x)
        res[kernels] = (y, *_grads([y], (x, norm.weight)))
    for i, (a, b) in enumerate(zip(res["triton"], res["torch"], strict=True)):
        torch.testing.assert_close(a, b, **(DW32 if i == 2 else FP32))


class _Ops(TorchDispatchMode):
    """The aten / custom ops a block runs, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("n, d", [(41, 96), (300, 1024)])
def test_add_rmsnorm_backward_writes_the_bf16_branch_gradient_as_its_cast(n, d, monkeypatch):
    """x fp32 (the residual stream) + a bf16 branch output: the branch's gradient comes out of the
    backward kernel in bf16, bitwise the fp32 gradient (the residual's) rounded to nearest even as
    torch's cast rounds it, with no cast op; against the torch path as the other tests bound it.
    300 x 1024 with 2 programs: several tiles per program."""
    from longctx_moe.kernels import triton_rmsnorm

    monkeypatch.setattr(triton_rmsnorm, "_MAX_PROGS", 2)
    norms = _norms(d)
    x = torch.randn(n, d, requires_grad=True)
    r = (3 * torch.randn(n, d)).to(torch.bfloat16).requires_grad_()
    res = {}
    for kernels, norm in norms.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s, y = norm(x, residual=r)
        g_s = torch.randn(n, d, generator=torch.Generator().manual_seed(1))
        g_y = torch.randn(n, d, generator=torch.Generator().manual_seed(2)).to(y.dtype)
        with _Ops() as ops:
            res[kernels] = torch.autograd.grad((s, y), (x, r, norm.weight), (g_s, g_y))
        if kernels == "triton":
            assert "add_rmsnorm_bwd" in ops.names and "_to_copy" not in ops.names, ops.names
    dx, dr, _ = res["triton"]
    assert dx.dtype == torch.float32 and dr.dtype == torch.bfloat16
    assert torch.equal(dr, dx.to(torch.bfloat16))
    torch.testing.assert_close(dx, res["torch"][0], **FP32)
    torch.testing.assert_close(dr, res["torch"][1], **BF16)
    # dw: DW32's bound, which holds N ulps for N <= 50 rows, grown with the rows summed
    torch.testing.assert_close(res["triton"][2], res["torch"][2], rtol=1e-6, atol=1e-7 * n)


def _block_with_its_own_add(self, x_TD, layout, replay_TK=None, branch_TD=None):
    """Block.forward as the plain composition: x + attn(norm(x)), then + ffn(norm(.)), summed in
    the block by autograd's add (no branch handed on)."""
    x_TD = x_TD if branch_TD is None else x_TD + branch_TD
    x_TD, n_TD = self.ffn_norm(x_TD, residual=self.attn(self.attn_norm(x_TD), layout))
    h_TD, stats = self.ffn(n_TD, layout, replay_TK) if self.is_moe else (self.ffn(n_TD), None)
    return x_TD + h_TD, None, stats


def _model_step(monkeypatch, plain: bool):
    from longctx_moe.model.transformer import Block, build_model
    from tests.model.helpers import packed_batch, tiny_config, tiny_ops

    if plain:
        monkeypatch.setattr(Block, "forward", _block_with_its_own_add)
    torch.manual_seed(0)
    model = build_model(tiny_config(num_layers=3, first_k_dense=1), tiny_ops(compute=torch.bfloat16, norm="triton"))
    batch = packed_batch([9, 14], 64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch).ce_sum
    params = [p for p in model.parameters() if p.requires_grad]
    with _Ops() as ops:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss, grads, collections.Counter(ops.names)


def test_block_end_add_in_the_next_norm_is_the_plain_sum_bitwise(monkeypatch):
    """Each block hands its FFN output to the next block's attention norm, which adds it to the
    fp32 stream in its kernel: the loss and every gradient are bitwise those of the blocks summing
    their own output (the same adds, in fp32, the same norms; the bf16 branch's gradient rounded
    as autograd's cast rounds it), with one fused backward more per block after the first (3
    blocks: 2 x 3 - 1 = 5, the last block's sum stays a plain add before the final norm) and one
    cast of the stream's gradient less."""
    deferred = _model_step(monkeypatch, plain=False)
    monkeypatch.undo()
    plain = _model_step(monkeypatch, plain=True)
    assert torch.equal(deferred[0], plain[0])
    for a, b in zip(deferred[1], plain[1], strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert (deferred[2]["add_rmsnorm_bwd"], plain[2]["add_rmsnorm_bwd"]) == (5, 3)
    assert deferred[2]["_to_copy"] == plain[2]["_to_copy"] - 2


def test_backward_of_no_rows_gives_a_zero_weight_gradient():
    """No row runs the kernel: the weight gradient's partials are zero-filled then (every
    program of a launch stores its whole row, so they are not otherwise)."""
    x, w = torch.randn(0, 32), torch.randn(32)
    _, r = torch.ops.longctx.rmsnorm_fwd(x, w, 1e-6, torch.float32)
    dx, dw = torch.ops.longctx.rmsnorm_bwd(torch.randn(0, 32), None, x, w, r)
    assert dx.shape == (0, 32) and torch.equal(dw, torch.zeros(32))
