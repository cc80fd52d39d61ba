"""Payload compression of the expert all-to-all: codec bounds, wire bytes, and the dispatch path.

The fp8 bound is the one stated in longctx_moe/parallel/comm.py:
    |decode(encode(x)) - x| <= 2^-4 |x| + 2^-10 s,   s = amax(|row|) / 448,
plus fp32 rounding of x / s and of q * s (relative 2^-23 each), covered by a 1e-6 relative slack.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.parallel.comm import FP8_ABS_BOUND, FP8_MAX, FP8_REL_BOUND, make_codec
from longctx_moe.parallel.dispatch import AllToAllDispatcher
from tests.launcher import run_distributed


def _round_trip(name, x):
    codec = make_codec(name)
    return codec.decode(codec.encode(x), x.dtype, x.shape[1])


def _fp8_bound(x):
    s = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return FP8_REL_BOUND * x.abs() * (1 + 1e-6) + FP8_ABS_BOUND * s + 1e-30


def test_fp8_round_trip_within_stated_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g, dtype=torch.float64)
    # Rows spanning magnitudes, a row with one outlier (small entries fall into subnormals), zeros.
    x[1] *= 1e6
    x[2] *= 1e-6
    x[3, 0] = 1e4
    x[4] = 0.0
    err = (_round_trip("fp8", x) - x).abs()
    assert bool((err <= _fp8_bound(x)).all()), (err / _fp8_bound(x)).max()
    assert torch.equal(_round_trip("fp8", x[4:5]), x[4:5])  # zeros stay exact
    # The bound is not vacuous: the worst relative error is well above bf16's 2^-8.
    rel = (err / x.abs().clamp_min(1e-300))[5:]
    assert rel.max() > 2.0**-6 and rel.max() <= FP8_REL_BOUND * (1 + 1e-6)


def test_bf16_round_trip_and_wire_bytes():
    x = torch.randn(16, 40, dtype=torch.float32)
    # bf16 keeps 8 significant bits: unit roundoff 2^-8.
    assert ((_round_trip("bf16", x) - x).abs() <= 2.0**-8 * x.abs()).all()
    assert torch.equal(_round_trip("none", x), x)
    per_row = {n: make_codec(n).wire_bytes_per_row(40, torch.float32) for n in ("none", "bf16", "fp8")}
    assert per_row == {"none": 160, "bf16": 80, "fp8": 44}
    assert make_codec("fp8").encode(x).shape == (16, 44)


D = 16


def _rank_data(rank, world):
    g = torch.Generator().manual_seed(rank)
    T = 10 + rank
    x = torch.randn(T, D, generator=g) * (1 + 100 * torch.rand(T, 1, generator=g))
    return x, torch.randint(0, 2 * world, (T, 1), generator=g)


class _Identity:
    num_local_experts = 2

    def __call__(self, x_MD, tokens_L):
        return x_MD


def _check_fp8_dispatch(rank, world):
    # Identity experts and one expert per token with weight 1: y = combine(dispatch(x)), so the
    # compressed path must equal the codec round trips done locally, bit for bit.
    x, idx = _rank_data(rank, world)
    w = torch.ones(x.shape[0], 1)
    out = {}
    for name in ("none", "bf16", "fp8"):
        disp = AllToAllDispatcher(2 * world, dist.group.WORLD, dispatch_dtype=name)
        y = disp(x, idx, w, _Identity())
        want = x if name == "none" else _round_trip("bf16", _round_trip(name, x))
        assert torch.equal(y, want), name
        out[name] = disp.wire_bytes
    # fp8 there, bf16 back: |y - x| <= 2^-8 |q| + bound(x) with |q| <= |x| + bound(x).
    assert torch.all((y - x).abs() <= _fp8_bound(x) * (1 + 2.0**-8) + 2.0**-8 * x.abs())
    # Rows to the other ranks (experts 2r, 2r+1 live on rank r) and rows they send me.
    sent = int((idx.flatten() // 2 != rank).sum())
    got = sum(int((_rank_data(r, world)[1].flatten() // 2 == rank).sum())
              for r in range(world) if r != rank)
    out["expected"] = {"none": (sent + got) * 4 * D, "bf16": (sent + got) * 2 * D,
                       "fp8": sent * (D + 4) + got * 2 * D}
    return out


@pytest.mark.slow
def test_compressed_all_to_all_equals_local_round_trip():
    res = run_distributed(_check_fp8_dispatch, world_size=3, timeout=120)
    for r in res:
        # fp32 rows of 4*D bytes; bf16 2*D both ways; fp8 D + 4 (scale) out, bf16 back.
        assert {k: r[k] for k in ("none", "bf16", "fp8")} == r["expected"] and r["fp8"] > 0


def test_fp8_codec_in_runs_of_128_is_the_block_recipes_activation_operand():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 256, generator=g)
    x[2, 5] = 3e3  # an outlier costs only its own run of 128 features
    codec = make_codec("fp8", run=128)
    buf = codec.encode(x)
    assert buf.shape == (6, 256 + 8) and codec.wire_bytes_per_row(256, torch.float32) == 264
    back = codec.decode(buf, torch.float32, 256)
    s = x.view(6, 2, 128).abs().amax(dim=2, keepdim=True) / FP8_MAX
    bound = FP8_REL_BOUND * x.abs() * (1 + 1e-6) + FP8_ABS_BOUND * s.expand(6, 2, 128).reshape(6, 256) + 1e-30
    assert bool(((back - x).abs() <= bound).all())
    assert float((back - x)[2, 128:].abs().max()) <= float(x[2, 128:].abs().max()) * 2**-4
    tiles = codec.tiles(buf, 256)
    assert tiles.tile == (1, 128) and tiles.inv.shape == (6, 2)
    assert torch.equal(tiles.dequantize(), back)  # the experts see exactly the decoded rows


def _block_experts(local: int, offset: int):
    from longctx_moe.model.experts import GroupedExperts

    torch.manual_seed(0)
    full = GroupedExperts(4, 256, 128)
    torch.nn.init.normal_(full.w_gate_up, std=0.05)
    torch.nn.init.normal_(full.w_down, std=0.05)
    experts = GroupedExperts(local, 256, 128)
    with torch.no_grad():
        experts.w_gate_up.copy_(full.w_gate_up[offset:offset + local])
        experts.w_down.copy_(full.w_down[offset:offset + local])
    from longctx_moe.kernels import fp8

    experts.fp8, experts.fp8_scaling = "block", fp8.make_recipe("block")  # as execution.fp8's apply_fp8 sets them
    return experts


def _check_payload_reuse(rank, world):
    from longctx_moe.kernels import fp8

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(12 + rank, 256, generator=g).requires_grad_()
    idx = torch.randint(0, 4, (x.shape[0], 2), generator=g)
    w = torch.rand(x.shape[0], 2, generator=g)
    experts = _block_experts(2, 2 * rank)
    out = {}
    for reuse in (True, False, "async"):
        calls = []
        real = fp8.grouped_matmul

        def spy(x_MD, w_EDF, counts_E, cdtype, recipe="tensor", x_fp8=None, real=real, calls=calls):
            calls.append(None if x_fp8 is None else torch.equal(x_fp8.dequantize(), x_MD))
            return real(x_MD, w_EDF, counts_E, cdtype, recipe, x_fp8)

        tiles_made = []  # the forward's 1 x 128 quantisations (activations; gradients come later)
        real_tiles = fp8.quantize_tiles

        def count(x_RC, fmt, tile, real=real_tiles, made=tiles_made):
            made.append((fmt, tile))
            return real(x_RC, fmt, tile)

        fp8.grouped_matmul, fp8.quantize_tiles = spy, count
        try:
            # async: the tokens' all-to-all in flight while a (zero) shared expert runs
            disp = AllToAllDispatcher(4, dist.group.WORLD, dispatch_dtype="fp8", overlap=reuse == "async")
            if not reuse:  # the same wire format, decoded, and quantised again by the experts
                disp.codec, disp.block_codec = disp.block_codec, None
            x.grad = None
            experts.zero_grad()
            y = disp(x, idx, w, experts, shared=torch.zeros_like if reuse == "async" else None)
            forward_runs = tiles_made.count((fp8.E4M3, (1, fp8.BLOCK)))
            y.square().sum().backward()
        finally:
            fp8.grouped_matmul, fp8.quantize_tiles = real, real_tiles
        out[reuse] = (y.detach(), x.grad.clone(), experts.w_gate_up.grad.clone(), calls, disp.wire_bytes,
                      forward_runs)
    (y1, dx1, dw1, calls1, bytes1, runs1), (y0, dx0, dw0, calls0, bytes0, runs0) = out[True], out[False]
    y2, dx2, _, calls2, _, _ = out["async"]
    return {"calls_reuse": calls1, "calls_plain": calls0, "bytes": (bytes1, bytes0), "runs": (runs1, runs0),
            "async_same": calls2 == calls1 and torch.equal(y2, y1) and torch.equal(dx2, dx1),
            "diffs": [float((a - b).abs().max() / b.abs().max()) for a, b in ((y1, y0), (dx1, dx0), (dw1, dw0))]}


@pytest.mark.slow
def test_fp8_dispatch_payload_is_the_block_experts_first_gemm_operand():
    """Under execution.fp8_recipe=block the tokens travel in the experts' own 1 x 128 FP8 tiles and
    their first GEMM takes them as they arrived (its x_fp8 dequantises to exactly the decoded
    rows); the down projection quantises its own input. The result equals the path that decodes
    and quantises again, up to float32 rounding of the scales (requantising a decoded e4m3 value
    gives the same e4m3 value back)."""
    for r in run_distributed(_check_payload_reuse, world_size=2, timeout=120):
        assert r["calls_reuse"] == [True, None] and r["calls_plain"] == [None, None]
        assert r["bytes"][0] == r["bytes"][1] > 0
        assert r["runs"] == (1, 2)  # reused: only the down projection's input is quantised
        assert r["async_same"]  # the asynchronous all-to-all hands over its payload too
        assert max(r["diffs"]) < 1e-5, r["diffs"]
