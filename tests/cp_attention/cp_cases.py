"""Shared helpers of the CP executor tests: random packed layouts (generated in the parent with a
seeded numpy RNG, so every rank sees the same cases), a dense float64 reference written here
independently of the kernels, and the per-rank comparison.

Legend: T physical tokens, L local tokens, H heads, D head dim.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cp_attention.plan import plan_cp


def make_layout(rng: np.random.Generator, p: int, multiple: int, max_docs: int = 40):
    """(doc lengths, slot lengths) of one random pack; slots are multiples of `multiple` (=2P
    times TP in the data pipeline). Mixes the edge cases the CP code must survive."""
    kind = rng.integers(0, 5)
    if kind == 0:  # one document spanning every rank, plus a few short ones
        lens = [int(rng.integers(2 * multiple, 5 * multiple))] + list(rng.integers(1, 7, rng.integers(0, 4)))
    elif kind == 1:  # a single token: most ranks get no real token
        lens = [1]
    elif kind == 2:  # many tiny documents: lengths 1, below P, not divisible by 2P
        lens = list(rng.integers(1, p + 2, rng.integers(1, max_docs + 1)))
    elif kind == 3:  # empty documents (all-padding slots) between real ones
        lens = [int(x) if rng.random() < 0.7 else 0 for x in rng.integers(1, 3 * multiple, rng.integers(1, 8))]
    else:
        lens = list(rng.integers(1, 4 * multiple, rng.integers(1, 12)))
    lens = [int(x) for x in lens]
    slots = [max(multiple, math.ceil(n / multiple) * multiple) for n in lens]
    if rng.random() < 0.3:  # an extra padding block in some slot
        slots[int(rng.integers(0, len(slots)))] += multiple
    return lens, slots


def make_cases(seed: int, p: int, n: int, multiple: int | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        lens, slots = make_layout(rng, p, multiple or 2 * p)
        placement = "zigzag" if rng.random() < 0.3 else "auto"
        max_imb = float(rng.choice([1.0, 1.05, 1.3, 100.0]))
        cases.append(dict(lens=lens, slots=slots, placement=placement, max_imbalance=max_imb,
                          seed=seed * 1000 + i))
    return cases


@st.composite
def layout_case(draw, p: int, multiple: int, max_docs: int = 40) -> dict:
    """A hypothesis-drawn pack: 1-40 documents of length 0 (an all-padding slot) to 4 slots'
    worth, each slot a multiple of `multiple`, some with an extra padding block; both placements
    and a range of balance limits. Hypothesis favours the boundaries (length 1, exact multiples,
    one huge document, all documents tiny) that a uniform generator rarely hits."""
    lens = draw(st.lists(st.integers(0, 4 * multiple), min_size=1, max_size=max_docs))
    if max(lens) == 0:
        lens[0] = 1
    extra = draw(st.lists(st.booleans(), min_size=len(lens), max_size=len(lens)))
    slots = [max(multiple, math.ceil(n / multiple) * multiple) + (multiple if e else 0)
             for n, e in zip(lens, extra, strict=True)]
    return dict(lens=lens, slots=slots, placement=draw(st.sampled_from(["auto", "zigzag"])),
                max_imbalance=draw(st.sampled_from([1.0, 1.05, 1.3, 100.0])),
                seed=draw(st.integers(0, 2**31 - 1)))


def hypothesis_cases(p: int, n: int, multiple: int | None = None) -> list[dict]:
    """n cases drawn by hypothesis in the parent (derandomized: the same list on every run and
    every rank), for tests that start their process group once and loop over cases inside it.
    Shrinking would need a process group per example, so a failure reports the case instead."""
    cases: list[dict] = []

    @settings(max_examples=n, database=None, derandomize=True, phases=[Phase.generate],
              deadline=None, suppress_health_check=list(HealthCheck))
    @given(layout_case(p, multiple or 2 * p))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(np.cumsum(lengths, dtype=np.int64)), dtype=torch.int32)


def plan_case(case: dict, cp_size: int, hierarchical_sizes=None):
    return plan_cp(cu_of(case["lens"]), cu_of(case["slots"]), cp_size,
                   placement=case["placement"], max_imbalance=case["max_imbalance"],
                   hierarchical_sizes=hierarchical_sizes)


def real_mask(lens: list[int], slots: list[int]) -> torch.Tensor:
    mask = torch.zeros(sum(slots), dtype=torch.bool)
    start = 0
    for n, s in zip(lens, slots, strict=True):
        mask[start:start + n] = True
        start += s
    return mask


def random_qkv(case: dict, hq: int, hkv: int, d: int, dtype=torch.float64, dv: int | None = None):
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], dout [T, Hq, Dv]) from the case seed
    (Dv = dv, default D)."""
    g = torch.Generator().manual_seed(case["seed"])
    t, dv = sum(case["slots"]), dv or d
    q, dout = (torch.randn(t, hq, n, generator=g, dtype=torch.float64) for n in (d, dv))
    k, v = (torch.randn(t, hkv, n, generator=g, dtype=torch.float64) for n in (d, dv))
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def _doc_mask(n: int, window: int | None) -> torch.Tensor:
    """bool [n, n]: causal, and at most `window` latest keys (the query's own included)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & (i - j < window) if window is not None else j <= i


def dense_reference(q, k, v, lens, slots, scale=None, window=None, sink=None):
    """Causal masked softmax attention per document, float64, via plain tensor maths.
    -> out [T, Hq, Dv] (0 at padding), lse [Hq, T] (-inf at padding); differentiable.
    window: the latest `window` keys only; sink [Hq]: one more softmax column with no value
    (its rows' lse includes it, padding rows then have lse = sink)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    outs, lses, start = [], [], 0
    for n, s in zip(lens, slots, strict=True):
        qd = q[start:start + n]
        kd = k[start:start + n].repeat_interleave(hq // hkv, dim=1)
        vd = v[start:start + n].repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        scores = scores.masked_fill(~_doc_mask(n, window), float("-inf"))
        if sink is not None:
            scores = torch.cat([scores, sink.double()[:, None, None].expand(hq, n, 1)], dim=-1)
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p[..., :n], vd))
        lses.append(lse)
        outs.append(q.new_zeros(s - n, hq, vd.shape[2]))
        lses.append(q.new_full((hq, s - n), float("-inf")) if sink is None
                    else sink.double()[:, None].expand(hq, s - n))
        start += s
    return torch.cat(outs), torch.cat(lses, dim=1)


def reference_with_grads(q, k, v, dout, lens, slots):
    """float64 reference (out, lse, dq, dk, dv) over the whole pack."""
    q, k, v = (x.detach().to(torch.float64).requires_grad_() for x in (q, k, v))
    out, lse = dense_reference(q, k, v, lens, slots)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(torch.float64))
    return out.detach(), lse.detach(), dq, dk, dv


def assert_close_local(name, got, want, atol, rtol=0.0):
    """Compare a local result with the reference shard; -inf must match exactly."""
    got = got.to(torch.float64)
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    assert torch.equal(inf_got, inf_want), f"{name}: -inf pattern differs"
    g, w = got[~inf_got], want[~inf_want]
    assert not torch.isnan(got).any(), f"{name}: NaN"
    if g.numel():
        err = ((g - w).abs() - rtol * w.abs()).max().item()
        assert err <= atol, f"{name}: max error {err:.3e} > {atol:.1e}"


def run_and_check(call, case, plan, cp_rank, heads, dtype, atol, rtol=0.0, tp=(0, 1)):
    """Run `call(q, k, v) -> (out, lse)` on this rank's shard, backprop a random dout, and compare
    out, lse, dq, dk, dv with the float64 reference shard. Gradients at padding must be exactly 0.
    tp = (tp_rank, tp_size): the rank holds only its TP share of the query and KV heads (CP x TP).
    Returns the local results (for bitwise comparison of repeated runs)."""
    hq, hkv, d = heads
    q, k, v, dout = random_qkv(case, hq, hkv, d, dtype)
    ref = reference_with_grads(q, k, v, dout, case["lens"], case["slots"])
    if tp[1] > 1:  # attention is per head: the TP shard's reference is the full one's head slice
        sq = slice(tp[0] * hq // tp[1], (tp[0] + 1) * hq // tp[1])
        sk = slice(tp[0] * hkv // tp[1], (tp[0] + 1) * hkv // tp[1])
        q, k, v, dout = q[:, sq], k[:, sk], v[:, sk], dout[:, sq]
        ref = (ref[0][:, sq], ref[1][sq], ref[2][:, sq], ref[3][:, sk], ref[4][:, sk])
    ql, kl, vl = (plan.shard(x, cp_rank).clone().requires_grad_() for x in (q, k, v))
    out, lse = call(ql, kl, vl)
    out.backward(plan.shard(dout, cp_rank))
    idx = plan.rank_index[cp_rank]
    got = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
    want = (ref[0][idx], ref[1][:, idx], ref[2][idx], ref[3][idx], ref[4][idx])
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == (torch.promote_types(dtype, torch.float32) if name == "lse" else dtype), name
        assert_close_local(f"{name} (case seed {case['seed']})", g, w, atol, rtol)
    pad = ~real_mask(case["lens"], case["slots"])[idx]
    for name, g in zip(("dq", "dk", "dv"), got[2:], strict=True):
        assert bool((g[pad] == 0).all()), f"{name} at padding positions is not exactly zero"
    assert bool((got[0][pad] == 0).all()), "out at padding positions is not zero"
    return got


def bf16_row(lens, hq, hkv, d, pad, seed):
    """(q, k, v, dout, cu_seqlens int32, longest) of a packed bf16 row of documents `lens` plus
    `pad` tokens after the last: the inputs of the single-device kernel tests."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1]) + pad
    q, dout = (torch.randn(t, hq, d, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(t, hkv, d, generator=g).bfloat16() for _ in range(2))
    return q, k, v, dout, cu, max(lens)
