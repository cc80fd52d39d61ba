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
