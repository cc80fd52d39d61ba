"""execution.fp8=torch: torch._scaled_mm FP8 GEMMs (longctx_moe.kernels.fp8) against a float64
reference of the same recipe, run on CPU (where _scaled_mm runs too, slowly).

The reference quantises each operand exactly as the recipe says (one scale per tensor, or per
expert weight: the largest |x| maps onto the format's largest finite value; E4M3 for activations
and weights, E5M2 for output gradients), dequantises in float64 and multiplies in float64. Our
products then differ from it only by float32 accumulation and the float32 reciprocal of the
scale: ~1e-6 relative; 1e-5 is allowed. A wrong format (E4M3 gradients: one more mantissa bit),
a wrong scale or a missed operand moves results by percents.
"""

from __future__ import annotations

import pytest
import torch

from longctx_moe.build import ConfigError, resolve_ops
from longctx_moe.config import load_config
from longctx_moe.execution import default_ops
from longctx_moe.kernels import fp8
from longctx_moe.model import ModelConfig, build_model
from longctx_moe.model.fp8 import Fp8Linear
from tests.kernels import scaled_mm
from tests.model.helpers import packed_batch

TOL = 1e-5


def _dq(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """The recipe's quantise-dequantise of x, in float64."""
    top = torch.finfo(fmt).max
    amax = x.detach().double().abs().max()
    scale = top / amax if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
    # the scale is formed in float32, as the recipe forms it
    scale = torch.tensor(float(top) / float(amax), dtype=torch.float32).double() if amax > 0 else scale
    return (x.detach().double() * scale).clamp(-top, top).to(fmt).double() / scale


def _recorded(monkeypatch, gemm) -> list:
    """torch._scaled_mm replaced by `gemm`, each call's operand formats recorded."""
    calls = []

    def recording(a, b, scale_a, scale_b, out_dtype):
        calls.append((a.dtype, b.dtype))
        return gemm(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    return calls


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Every torch._scaled_mm call, run by CPU's own op, each checked first against what cuBLAS's
    FP8 GEMM accepts on a GPU (CPU's _scaled_mm accepts more, so a layout or padding slip would
    pass here unseen): see tests/kernels/scaled_mm.py."""

    def checked(a, b, scale_a, scale_b, out_dtype):
        scaled_mm.check_cublas_operands(a, b, scale_a, scale_b)
        return scaled_mm.REAL(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    return _recorded(monkeypatch, checked)


@pytest.fixture
def fast_scaled_mm_calls(monkeypatch):
    """As scaled_mm_calls, run by the float32 stand-in: for the tests that run a whole model, whose
    GEMMs CPU's reference-loop op takes seconds over (the GEMMs themselves are judged above)."""
    return _recorded(monkeypatch, scaled_mm.stand_in)


def _close(a: torch.Tensor, ref: torch.Tensor) -> None:
    err = float((a.double() - ref).abs().max()) / float(ref.abs().max())
    assert err < TOL, err


def test_quantize_scales_to_the_format_maximum_and_keeps_zeros_and_nonfinite():
    x = torch.randn(64, 32) * 3
    x_q, inv = fp8.quantize(x, fp8.E4M3)
    assert x_q.dtype == fp8.E4M3 and float(x_q.float().abs().max()) == torch.finfo(fp8.E4M3).max
    back = x_q.double() * float(inv)
    assert 0 < float((back - x.double()).abs().max()) <= float(x.abs().max()) * 2**-4  # 3 mantissa bits
    z_q, z_inv = fp8.quantize(torch.zeros(3, 3), fp8.E5M2)
    assert float(z_inv) == 1.0 and not z_q.float().any()
    bad = x.clone()
    bad[0, 0] = float("inf")
    b_q, b_inv = fp8.quantize(bad, fp8.E4M3)
    assert not torch.isfinite(b_q.float() * b_inv).all()


@pytest.mark.parametrize("m", [37, 48])  # 37: the weight gradient's contraction is zero-padded
@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_and_both_gradients_match_the_float64_recipe(m, bias, scaled_mm_calls):
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 64, generator=g) * 2).requires_grad_()
    w = (torch.randn(48, 64, generator=g) / 8).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_() if bias else None
    dy = torch.randn(m, 48, generator=g) * 1e-3
    y = fp8.linear(x, w, b, torch.float32)
    y.backward(dy)
    xd, wd, gd = _dq(x, fp8.E4M3), _dq(w, fp8.E4M3), _dq(dy, fp8.E5M2)
    ref = xd @ wd.t() + (0 if b is None else b.detach().double())
    _close(y.detach(), ref)
    _close(x.grad, gd @ wd)
    _close(w.grad, gd.t() @ xd)
    assert w.grad.dtype == torch.float32
    assert scaled_mm_calls == [(fp8.E4M3, fp8.E4M3), (fp8.E5M2, fp8.E4M3), (fp8.E5M2, fp8.E4M3)]
    if bias:
        torch.testing.assert_close(b.grad, dy.sum(0), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("formats", [(fp8.E4M3, fp8.E4M3), (fp8.E5M2, fp8.E4M3)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_stand_in_computes_what_cpus_scaled_mm_does(formats, out_dtype):
    """The model-level tests run the float32 stand-in (tests/kernels/scaled_mm.py): it agrees with
    CPU's op to float32 rounding (the two sum in different orders), and so to one bf16 step."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(40, 64, generator=g) * 3).to(formats[0])
    b = torch.randn(48, 64, generator=g).to(formats[1]).t()
    scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
    ours = scaled_mm.stand_in(a, b, scale_a, scale_b, out_dtype).double()
    cpu = scaled_mm.REAL(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype).double()
    step = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-6
    assert float((ours - cpu).abs().max()) <= step * float(cpu.abs().max())
    with pytest.raises(AssertionError, match="E5M2 x E5M2"):
        scaled_mm.stand_in(a.float().to(fp8.E5M2), b.float().to(fp8.E5M2), scale_a, scale_b, out_dtype)


def test_linear_keeps_leading_dims_and_computes_in_the_autocast_dtype():
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, bias=False)
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.shape == (2, 5, 16) and y.dtype == torch.bfloat16
    ref = (_dq(x, fp8.E4M3) @ _dq(lin.weight, fp8.E4M3).t()).view(2, 5, 16)
    # a bf16 result: within one bf16 step of the largest value (CPU's _scaled_mm does not round
    # its float32 sum exactly once; 200 seeds gave at most 0.47 of a step)
    assert float((y.detach().double() - ref).abs().max()) <= float(ref.abs().max()) * 2**-7


def test_stacked_expert_weights_quantise_as_each_expert_alone():
    # one set of ops for all experts (a GPU step issues 5 kernels per layer, not 5 per expert)
    w = torch.randn(3, 256, 128) * torch.tensor([1.0, 1e-3, 50.0]).view(3, 1, 1)
    for e, (q, inv) in enumerate(fp8.RECIPES["tensor"].weights(w)):
        q1, inv1 = fp8.quantize(w[e], fp8.E4M3)
        assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(inv.view(()), inv1)
    for e, t in enumerate(fp8.RECIPES["block"].weights(w)):
        t1 = fp8.quantize_tiles(w[e], fp8.E4M3, (128, 128))
        assert torch.equal(t.data.view(torch.uint8), t1.data.view(torch.uint8)) and torch.equal(t.inv, t1.inv)


def _grouped_run(seed: int, counts: torch.Tensor, d: int, f: int, recipe: str = "tensor"):
    """(x, w, dy, y) of a grouped FP8 GEMM after its backward, on experts of very different
    magnitudes (one weight scale for all would flush the small one to zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(int(counts.sum()), d, generator=g).requires_grad_()
    w = (torch.randn(4, d, f, generator=g) * torch.tensor([1.0, 1.0, 1e-3, 10.0]).view(4, 1, 1))
    w.requires_grad_()
    dy = torch.randn(x.shape[0], f, generator=g)
    y = fp8.grouped_matmul(x, w, counts.tolist(), torch.float32, recipe)
    y.backward(dy)
    return x, w, dy, y


def test_grouped_matmul_scales_each_expert_and_handles_an_expert_without_rows(scaled_mm_calls):
    counts = torch.tensor([5, 0, 19, 8])
    x, w, dy, y = _grouped_run(1, counts, 32, 16)
    xd, gd = _dq(x, fp8.E4M3), _dq(dy, fp8.E5M2)
    rows = torch.split(torch.arange(x.shape[0]), counts.tolist())
    wd = [_dq(w[e], fp8.E4M3) for e in range(4)]
    for e, r in enumerate(rows):
        if len(r) == 0:
            assert not w.grad[e].any()
            continue
        _close(y.detach()[r], xd[r] @ wd[e])
        _close(x.grad[r], gd[r] @ wd[e].t())
        _close(w.grad[e], xd[r].t() @ gd[r])


def _model_pair(**kw):
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, num_experts=4, top_k=2, expert_hidden_size=32, **kw)
    torch.manual_seed(0)
    ref = build_model(cfg)
    torch.manual_seed(0)
    ours = build_model(cfg, default_ops().replace(fp8="torch"))
    return ref, ours


def _loss(model, batch):
    out = model(batch)
    return out.ce_sum / batch.num_target_tokens()


def test_the_fp8_model_has_the_same_parameters_and_runs_every_block_gemm_in_fp8(fast_scaled_mm_calls):
    ref, ours = _model_pair()
    assert list(ref.state_dict()) == list(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    batch = packed_batch([40, 100, 116], 256, generator=torch.Generator().manual_seed(0))
    routed = sum(int(c > 0) for c in _expert_counts(ours, batch))
    calls = fast_scaled_mm_calls
    calls.clear()
    loss = _loss(ours, batch)
    n_fwd = len(calls)
    assert n_fwd == 2 * 4 + 2 * routed  # 4 attention projections a layer, 2 GEMMs per expert with rows
    loss.backward()
    assert len(calls) == 3 * n_fwd  # dgrad and wgrad of every product
    ref_loss, loss = _loss(ref, batch).item(), loss.item()
    # FP8 moves the loss, but little: 3 mantissa bits on 64-wide sums at init
    assert loss != ref_loss and abs(loss - ref_loss) < 2e-2 * ref_loss
    for name, p in ours.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name


def test_dense_layers_and_gated_shared_experts_run_in_fp8_but_the_gate_does_not(fast_scaled_mm_calls):
    # layer 0 dense (3 projections), layer 1 MoE with a gated shared expert (3, its gate not)
    _, ours = _model_pair(first_k_dense=1, dense_hidden_size=48, shared_expert_hidden_size=32,
                          shared_expert_gate=True)
    assert type(ours.layers[1].ffn.shared.gate) is torch.nn.Linear
    batch = packed_batch([30, 66], 256, generator=torch.Generator().manual_seed(1))
    routed = sum(int(c > 0) for c in _expert_counts(ours, batch))
    fast_scaled_mm_calls.clear()
    _loss(ours, batch).backward()
    assert len(fast_scaled_mm_calls) == 3 * (2 * 4 + 3 + 3 + 2 * routed)
    assert ours.layers[1].ffn.shared.gate.weight.grad is not None


def _expert_counts(model, batch):
    """Rows each expert of each layer got in `model`'s forward of `batch` (from its router)."""
    counts = []
    hooks = [blk.ffn.experts.register_forward_hook(
        lambda mod, args, out: counts.extend(args[1][:mod.num_local_experts].tolist()))
        for blk in model.layers if hasattr(blk.ffn, "experts")]
    with torch.no_grad():
        model(batch)
    for h in hooks:
        h.remove()
    return counts


def test_fp8_is_refused_in_one_line_where_it_cannot_run():
    for setting, tp, words in (("torch", 1, "cpu"), ("te", 1, "Transformer Engine"), ("torch", 2, "parallel.tp=2")):
        msg = fp8.unavailable_reason(setting, "cpu", tp)
        assert msg and "\n" not in msg and words in msg and "execution.fp8=none" in msg, msg
    assert fp8.unavailable_reason("none", "cpu", 4) is None
    cfg = load_config(None, ["execution.fp8=torch", "train.device=cpu"])
    with pytest.raises(ConfigError, match="needs a CUDA GPU with FP8 tensor cores, not cpu"):
        resolve_ops(cfg, torch.device("cpu"))
    with pytest.raises(Exception, match="execution.fp8"):
        load_config(None, ["execution.fp8=e4m3"])
    with pytest.raises(ValueError, match="Transformer Engine"):
        build_model(ModelConfig(), default_ops().replace(fp8="te"))


def test_widths_fp8_gemms_cannot_take_are_refused_at_start_up(monkeypatch):
    # hidden 72: every projection's input; expert hidden 40: the experts' down projection
    for sets, where in ((["model.hidden_size=72"], "layers.0.attn.wq has width 72"),
                        (["model.expert_hidden_size=40"], "layers.0.ffn.experts has width 40")):
        cfg = load_config(None, ["execution.fp8=torch", *sets])
        monkeypatch.setattr(fp8, "unavailable_reason", lambda *a: None)  # as on an FP8 GPU
        with pytest.raises(ConfigError, match=where) as e:
            resolve_ops(cfg, torch.device("cpu"))
        assert "\n" not in str(e.value) and "execution.fp8=none" in str(e.value)
    resolve_ops(load_config(None, ["execution.fp8=torch"]), torch.device("cpu"))  # 128 / 32 wide: fine


def test_recompute_reruns_the_fp8_products_exactly(fast_scaled_mm_calls):
    # quantisation is a pure function of its input: a recomputed forward quantises alike
    _, ours = _model_pair()
    _assert_recompute_exact(ours, packed_batch([40, 100, 116], 256, generator=torch.Generator().manual_seed(0)))


def _assert_recompute_exact(model, batch):
    """Gradients under selective and full recompute equal those without, bit for bit."""
    grads = {}
    for mode in ("none", "selective", "full"):
        _set_recompute(model, mode)
        model.zero_grad()
        _loss(model, batch).backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[mode], strict=True)), mode


def _set_recompute(model, mode: str) -> None:
    """The recompute mode a model built with Ops(recompute=mode) has, set on this one (the same
    weights and FP8 scale state under each mode)."""
    model.recompute = mode
    for layer in model.moe_layers():
        layer.experts.recompute = mode == "selective"


# ---- execution.fp8_recipe=block: 1 x 128 activation / gradient runs, 128 x 128 weight blocks ----

def _dq_tiles(x: torch.Tensor, fmt: torch.dtype, tile: tuple[int, int]) -> torch.Tensor:
    """The block recipe's quantise-dequantise of x [R, C], tile by tile, in float64 (each tile
    by `_dq`'s per-tensor rule, which is the recipe's rule applied to one tile)."""
    out = torch.empty(x.shape, dtype=torch.float64)
    tr, tc = tile
    for r in range(0, x.shape[0], tr):
        for c in range(0, x.shape[1], tc):
            out[r:r + tr, c:c + tc] = _dq(x[r:r + tr, c:c + tc], fmt)
    return out


def _dq_rows_padded(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """x [M, C] quantised down its columns in runs of 128 rows (zero rows pad the last run)."""
    pad = -x.shape[0] % fp8.BLOCK
    xp = torch.cat([x.detach(), x.new_zeros(pad, x.shape[1])])
    return _dq_tiles(xp, fmt, (fp8.BLOCK, 1))[:x.shape[0]]


def test_quantize_tiles_gives_each_tile_its_own_scale():
    x = torch.randn(4, 256)
    x[1, 200] = 1e4  # an outlier: only its own 1 x 128 run loses precision
    q = fp8.quantize_tiles(x, fp8.E4M3, (1, 128))
    assert q.inv.shape == (4, 2) and q.data.dtype == fp8.E4M3
    # the same values up to the float32 reciprocal of each scale
    torch.testing.assert_close(q.dequantize().double(), _dq_tiles(x, fp8.E4M3, (1, 128)), rtol=1e-6, atol=0)
    err = (q.dequantize() - x).abs()
    assert float(err[1, :128].max()) <= float(x[1, :128].abs().max()) * 2**-4
    assert float(err[0].max()) <= float(x[0].abs().max()) * 2**-4
    w = fp8.quantize_tiles(torch.randn(256, 128), fp8.E4M3, (128, 128))
    assert w.inv.shape == (2, 1) and torch.equal(w.t().dequantize(), w.dequantize().t())


@pytest.mark.parametrize("m", [37, 300])  # the weight gradient's token runs: padded, and 2 full + 1 part
@pytest.mark.parametrize("bias", [False, True])
def test_block_linear_forward_and_both_gradients_match_the_float64_recipe(m, bias):
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 256, generator=g) * 2).requires_grad_()
    x.data[3, 130] = 300.0  # an outlier in one run of one token
    w = (torch.randn(128, 256, generator=g) / 8).requires_grad_()
    b = torch.randn(128, generator=g).requires_grad_() if bias else None
    dy = torch.randn(m, 128, generator=g) * 1e-3
    y = fp8.linear(x, w, b, torch.float32, recipe="block")
    y.backward(dy)
    wd = _dq_tiles(w, fp8.E4M3, (128, 128))
    ref = _dq_tiles(x, fp8.E4M3, (1, 128)) @ wd.t() + (0 if b is None else b.detach().double())
    _close(y.detach(), ref)
    _close(x.grad, _dq_tiles(dy, fp8.E5M2, (1, 128)) @ wd)
    _close(w.grad, _dq_rows_padded(dy, fp8.E5M2).t() @ _dq_rows_padded(x, fp8.E4M3))
    if bias:
        torch.testing.assert_close(b.grad, dy.sum(0), rtol=1e-6, atol=1e-9)
    # the recipe is not the per-tensor one: the outlier would cost every other token precision
    per_tensor = _dq(x, fp8.E4M3) @ _dq(w, fp8.E4M3).t() + (0 if b is None else b.detach().double())
    assert float((per_tensor - ref).abs().max()) > 10 * TOL * float(ref.abs().max())


def test_block_grouped_matmul_quantises_each_experts_rows_and_weight_on_their_own():
    counts = torch.tensor([5, 0, 140, 8])
    x, w, dy, y = _grouped_run(2, counts, 128, 256, "block")
    xd, gd = _dq_tiles(x, fp8.E4M3, (1, 128)), _dq_tiles(dy, fp8.E5M2, (1, 128))
    rows = torch.split(torch.arange(x.shape[0]), counts.tolist())
    for e, r in enumerate(rows):
        if len(r) == 0:
            assert not w.grad[e].any()
            continue
        wd = _dq_tiles(w[e].t(), fp8.E4M3, (128, 128)).t()  # [D, F], blocks of the [F, D] weight
        _close(y.detach()[r], xd[r] @ wd)
        _close(x.grad[r], gd[r] @ wd.t())
        _close(w.grad[e], _dq_rows_padded(x[r], fp8.E4M3).t() @ _dq_rows_padded(dy[r], fp8.E5M2))


@pytest.mark.parametrize("tokens", [40, 512])
def test_block_gemms_on_a_gpu_take_the_layouts_torch_checks(tokens, monkeypatch):
    """The GPU branch of block_mm, its scaled_mm run on meta tensors: torch's own meta checks of
    F.scaled_mm's blockwise modes (scale shapes, outer-dim-major strides, the padding of the
    weight's scale rows to a multiple of 4) judge every call of a linear layer's three products."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_mm

    def on_meta(a, b, sa, ra, sb, rb, output_dtype):
        to_meta = [t.to("meta").as_strided(t.shape, t.stride()) for t in (a, b, sa, sb)]
        y = real(to_meta[0], to_meta[1], to_meta[2], ra, to_meta[3], rb, output_dtype=output_dtype)
        seen.append((ra, rb, tuple(y.shape)))
        return torch.zeros(y.shape, dtype=output_dtype)

    monkeypatch.setattr(F, "scaled_mm", on_meta)
    x = torch.randn(tokens, 640)  # K / 128 = 5: the weight's scales padded to 8 rows
    w = torch.randn(384, 640)
    for a, bt in ((fp8.quantize_tiles(x, fp8.E4M3, (1, 128)), fp8.quantize_tiles(w, fp8.E4M3, (128, 128)).t()),
                  (fp8.quantize_tiles(torch.randn(tokens, 384), fp8.E5M2, (1, 128)),
                   fp8.quantize_tiles(w, fp8.E4M3, (128, 128))),
                  (fp8.quantize_tiles(torch.randn(512, 384), fp8.E5M2, (128, 1)).t(),
                   fp8.quantize_tiles(torch.randn(512, 640), fp8.E4M3, (128, 1)))):
        out = fp8._block_mm_gpu(a, bt, torch.bfloat16)
        assert out.shape == (a.data.shape[0], bt.data.shape[1])
    B1, B128 = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    assert [(ra, rb) for ra, rb, _ in seen] == [(B1, B128), (B1, B128), (B1, B1)]


def test_block_recipe_model_trains_its_every_block_gemm_in_fp8():
    cfg = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                      head_dim=32, num_experts=4, top_k=2, expert_hidden_size=128)
    torch.manual_seed(0)
    ref = build_model(cfg)
    torch.manual_seed(0)
    ours = build_model(cfg, default_ops().replace(fp8="torch", fp8_recipe="block"))
    assert {m.fp8_recipe for m in ours.modules() if isinstance(m, Fp8Linear)} == {"block"}
    batch = packed_batch([40, 100, 116], 256, generator=torch.Generator().manual_seed(0))
    calls = []
    real = fp8.block_mm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8, "block_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
        loss = _loss(ours, batch)
        n_fwd = len(calls)
        loss.backward()
    routed = sum(int(c > 0) for c in _expert_counts(ours, batch))
    assert n_fwd == 2 * 4 + 2 * routed and len(calls) == 3 * n_fwd
    ref_loss, loss = _loss(ref, batch).item(), loss.item()
    assert loss != ref_loss and abs(loss - ref_loss) < 2e-2 * ref_loss


def test_block_recipe_refusals_name_the_width_and_the_fix(monkeypatch):
    monkeypatch.setattr(fp8, "unavailable_reason", lambda *a: None)  # as on a Hopper GPU
    cfg = load_config(None, ["execution.fp8=torch", "execution.fp8_recipe=block", "model.expert_hidden_size=192"])
    with pytest.raises(ConfigError, match="layers.0.attn.wk has width 64.*multiples of 128") as e:
        resolve_ops(cfg, torch.device("cpu"))  # kv heads x head dim = 64
    assert "\n" not in str(e.value) and "execution.fp8_recipe=tensor" in str(e.value)
    with pytest.raises(Exception, match="execution.fp8_recipe"):
        load_config(None, ["execution.fp8_recipe=mxfp8"])
    with pytest.raises(ValueError, match=r"\[256, 192\] operand does not split into 128 x 128 tiles") as e:
        fp8.RECIPES["block"].weights(torch.zeros(2, 256, 192))  # an ETP shard of a 384-wide expert
    assert "\n" not in str(e.value)
    # recipe keys without the setting they shape: refused, not ignored
    with pytest.raises(Exception, match="execution.fp8=none runs none"):
        load_config(None, ["execution.fp8_recipe=block"])
    with pytest.raises(Exception, match="history of execution.fp8_recipe=delayed"):
        load_config(None, ["execution.fp8=torch", "execution.fp8_amax_history=64"])
    load_config(None, ["execution.fp8=torch", "execution.fp8_recipe=delayed", "execution.fp8_amax_history=64"])


# ---- execution.fp8_recipe=delayed: scales from the amax of earlier steps ----

def test_amax_history_scales_from_earlier_steps_and_forgets_skipped_ones():
    h = fp8.AmaxHistory(fp8.E4M3, length=3)
    x = torch.randn(8, 16)
    q, inv = h.quantize(x)  # before any step boundary: the tensor's own scale (current scaling)
    q1, inv1 = fp8.quantize(x, fp8.E4M3)
    assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(inv, inv1)
    h.quantize(x * 4)  # a second micro-batch of the same step: the slot keeps the max
    h.advance(skipped=False)
    top, big = torch.finfo(fp8.E4M3).max, float(x.abs().max()) * 4
    torch.testing.assert_close(h.scale, torch.tensor(top / big), rtol=1e-6, atol=0)
    q, inv = h.quantize(x * 8)  # twice the history's max: saturates at the format's largest value
    assert float(q.float().abs().max()) == top and float(inv) == pytest.approx(big / top, rel=1e-6)
    h.quantize(torch.full((2, 2), 1e6))  # a step with an overflow is skipped: its amax never counts
    h.advance(skipped=True)
    assert float(h.amax[0]) == 0 and float(h.amax[1]) == pytest.approx(big)
    for _ in range(3):  # the big step leaves the 3-step window
        h.quantize(x)
        h.advance(skipped=False)
    torch.testing.assert_close(h.scale, top / x.abs().max(), rtol=1e-6, atol=0)


def _delayed_model():
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, num_experts=4, top_k=2, expert_hidden_size=32)
    torch.manual_seed(0)
    return build_model(cfg, default_ops().replace(fp8="torch", fp8_recipe="delayed", fp8_amax_history=4))


def test_delayed_recipe_quantises_with_frozen_scales_and_recompute_matches(fast_scaled_mm_calls):
    from longctx_moe.model.fp8 import advance_fp8

    model = _delayed_model()
    scalings = {id(m.fp8_scaling): m.fp8_scaling for m in model.modules() if hasattr(m, "fp8_scaling")}
    assert all(isinstance(s, fp8.DelayedScaling) for s in scalings.values()) and len(scalings) == 2 * 5
    batch = packed_batch([40, 100, 116], 256, generator=torch.Generator().manual_seed(0))
    _loss(model, batch).backward()
    advance_fp8(model)
    assert all(s.x.scale is not None and s.g.scale is not None for s in scalings.values())
    _assert_recompute_exact(model, batch)  # a step's calls all use the frozen scales


def test_delayed_forward_equals_current_scaling_at_the_frozen_scale(scaled_mm_calls):
    # after one step the activation is quantised with the history's scale, not its own: halve
    # the input and the quantised values halve too (current scaling would map it to 448 again)
    lin = fp8.DelayedScaling(2)
    x, w = torch.randn(32, 64), torch.randn(48, 64) / 8
    fp8.linear(x, w, None, torch.float32, lin)
    lin.advance()
    y = fp8.linear(x / 2, w, None, torch.float32, lin)
    top = torch.finfo(fp8.E4M3).max
    scale = top / float(x.abs().max())
    xd = ((x / 2).double() * scale).clamp(-top, top).to(fp8.E4M3).double() / scale
    _close(y, xd @ _dq(w, fp8.E4M3).t())


def test_the_trainer_advances_the_fp8_histories_each_optimizer_step(monkeypatch):
    from longctx_moe import trainer as trainer_mod

    seen = []
    monkeypatch.setattr(trainer_mod, "advance_fp8", lambda model, skipped: seen.append(skipped))
    from tests.trainer.test_split_step import _trainer

    tr = _trainer()
    batch = packed_batch([30, 50], tr.cfg.model.vocab_size, generator=torch.Generator().manual_seed(0))
    tr.train_step([batch])
    tr.train_step([batch])
    assert seen == [False, False]
