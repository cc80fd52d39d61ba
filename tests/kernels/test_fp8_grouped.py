"""The experts' FP8 forward as one grouped GEMM (kernels/fp8_grouped.py) on a CPU: every call is
judged by torch's own meta checks of `_scaled_grouped_mm` (E4M3 operands, a row-major, b
column-major per expert, row-wise float32 scales of the right shapes, int32 offsets, bf16 out),
and its scales and offsets are checked by a stand-in that computes what the op documents: rows
of expert e (ending at offs[e]) times b[e], scaled by scale_a per row and scale_b[e] per
column. It must equal the loop of one GEMM per expert."""

import pytest
import torch

from longctx_moe.kernels import fp8, fp8_grouped

TORCH_OP = torch._scaled_grouped_mm


def _stand_in(a, b, scale_a, scale_b, offs, out_dtype):
    on_meta = [t.to("meta").as_strided(t.shape, t.stride()) for t in (a, b, scale_a, scale_b, offs)]
    y = TORCH_OP(*on_meta[:4], offs=on_meta[4], out_dtype=out_dtype)  # torch's own checks
    ends = offs.tolist()
    parts = [(a[s:t].float() * scale_a[s:t, None]) @ (b[e].float() * scale_b[e]) for e, (s, t)
             in enumerate(zip([0, *ends[:-1]], ends, strict=True))]
    out = torch.cat(parts)
    assert out.shape == y.shape
    return out.to(out_dtype)


@pytest.fixture
def grouped_on_cpu(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _stand_in, raising=False)
    monkeypatch.setitem(fp8_grouped._state, "off", None)


def _operands(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    recipe = fp8.RECIPES["tensor"]
    x = recipe.act(torch.randn(sum(counts), 64, generator=g), counts)[0]
    w_EDF = torch.randn(len(counts), 64, 48, generator=g) * torch.tensor([1.0, 1e-2, 5.0, 1.0]).view(4, 1, 1)
    ws = recipe.weights(w_EDF.transpose(1, 2))  # as grouped_matmul quantises the experts' weights
    return recipe, x, ws


def test_one_grouped_call_passes_torchs_checks_and_equals_the_loop(grouped_on_cpu):
    counts = [5, 0, 19, 8]  # an expert without rows
    recipe, x, ws = _operands(counts)
    y = fp8_grouped.call(x, ws, counts)
    loop = torch.cat([recipe.fprop(p, ws[e], torch.float32) for e, p in enumerate(recipe.split(x, counts))])
    assert y.dtype == torch.bfloat16 and y.shape == (32, 48)
    torch.testing.assert_close(y.float(), loop.bfloat16().float(), rtol=2**-7, atol=1e-6)


def test_the_recipe_takes_the_grouped_path_where_the_run_resolved_it_and_the_loop_elsewhere(grouped_on_cpu,
                                                                                             monkeypatch):
    """The choice is the resolved Ops' (fp8_grouped, carried by the recipe object), not a device
    check per call: a run resolved for a Hopper takes it whatever device its tensors report."""
    counts = [3, 7, 0, 6]
    recipe, x, ws = _operands(counts, seed=1)
    calls, real_call = [], fp8_grouped.call
    monkeypatch.setattr(fp8_grouped, "call", lambda *a: calls.append(1) or real_call(*a))
    y = recipe.fprop_groups(x, ws, counts, torch.bfloat16)  # the stateless recipe: not resolved grouped
    assert calls == [] and y.shape == (16, 48)
    grouped = fp8.make_recipe("tensor", grouped=True)
    y = grouped.fprop_groups(x, ws, counts, torch.bfloat16)
    assert calls == [1] and y.shape == (16, 48) and y.dtype == torch.bfloat16
    grouped.fprop_groups(x, ws, counts, torch.float32)  # torch's grouped call writes bf16 only
    assert calls == [1] and fp8.make_recipe("delayed", 4, grouped=True).grouped
    assert fp8.make_recipe("block", grouped=True) is fp8.RECIPES["block"]  # it has no grouped call


def test_the_grouped_call_is_resolved_for_a_hopper_in_bf16_per_tensor_recipes_only(monkeypatch):
    from longctx_moe.execution import ExecutionConfig, Target, resolve

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    h100 = Target("cuda", torch.bfloat16, torch.float32)
    ops = resolve(ExecutionConfig(fp8="torch"), h100)
    assert ops.fp8_grouped and fp8.make_recipe(ops.fp8_recipe, grouped=ops.fp8_grouped).grouped
    assert not resolve(ExecutionConfig(fp8="torch"), Target("cuda", torch.float32, torch.float32)).fp8_grouped
    assert not resolve(ExecutionConfig(), h100).fp8_grouped
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))  # Ada: FP8, no grouped call
    ops = resolve(ExecutionConfig(fp8="torch"), h100)
    assert ops.fp8 == "torch" and not ops.fp8_grouped and "9.x" in dict(ops.reasons)["fp8_grouped"]


def test_a_failing_grouped_call_warns_once_and_the_loop_takes_over(monkeypatch):
    monkeypatch.setitem(fp8_grouped._state, "off", None)

    def broken(*a, **k):
        raise RuntimeError("CUDA error: misaligned address\nmore")

    monkeypatch.setattr(torch, "_scaled_grouped_mm", broken, raising=False)
    monkeypatch.setattr(fp8_grouped, "usable", lambda *a: fp8_grouped._state["off"] is None)
    counts = [4, 4, 4, 4]
    recipe, x, ws = _operands(counts, seed=2)
    with pytest.warns(UserWarning, match="grouped FP8 GEMM failed .*misaligned address.*one GEMM per expert"):
        y = fp8.make_recipe("tensor", grouped=True).fprop_groups(x, ws, counts, torch.float32)
    assert fp8_grouped._state["off"].startswith("RuntimeError: CUDA error: misaligned address")
    loop = torch.cat([recipe.fprop(p, ws[e], torch.float32) for e, p in enumerate(recipe.split(x, counts))])
    assert torch.equal(y, loop)
    assert not fp8_grouped.usable(x[0], torch.bfloat16, 4)  # off for the process from now on
