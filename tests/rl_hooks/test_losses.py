"""rl_hooks.losses against a per-token, per-sequence loop reference, plus the split invariant.

The reference below walks sequences and tokens with Python loops on 0-d tensors and Python
branches (no index_add, no vectorised where/clamp), so it shares no code path with the
implementation. Everything is float64. Tolerance 1e-12 throughout: both sides add at most ~20
terms of magnitude <= ~10 in different orders, so rounding differs by ~20 * 10 * 2.2e-16 ~ 5e-14;
1e-12 leaves margin for that and still catches any formula or normaliser error (>= 1e-4 here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rl_hooks.losses import (
    AGGS,
    LossInputs,
    Normalizers,
    PolicyLossConfig,
    aggregate,
    kl_estimate,
    make_loss,
    policy_loss,
)

F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)  # see the module docstring
C = 16.0  # seq-mean-token-sum-norm's fixed length in these tests


# ---------------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    """A mini-batch of whole sequences; logp and entropy are leaves with grad."""

    lengths: list[int]
    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor
    rollout: torch.Tensor
    entropy: torch.Tensor

    def offset(self, s: int) -> int:
        return sum(self.lengths[:s])

    def norm(self) -> Normalizers:
        return Normalizers(num_tokens=sum(self.lengths), num_seqs=len(self.lengths), constant=C)

    def inputs(self, s0: int = 0, s1: int | None = None) -> LossInputs:
        """The micro-batch of sequences [s0, s1)."""
        s1 = len(self.lengths) if s1 is None else s1
        a, b = self.offset(s0), self.offset(s1)
        lens = torch.tensor(self.lengths[s0:s1], dtype=torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(s1 - s0), lens)
        return LossInputs(self.logp[a:b], self.old[a:b], self.adv[a:b], seq_index, s1 - s0,
                          ref_logprobs=self.ref[a:b], rollout_logprobs=self.rollout[a:b],
                          entropy=self.entropy[a:b])


def make_batch(lengths, seed=0, spread=0.3, **fixed) -> Batch:
    """Random float64 batch; `fixed` overrides any field with explicit per-token values."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    old = -3 * torch.rand(n, generator=g, dtype=F64) - 0.1
    t = dict(
        old=old,
        logp=old + spread * torch.randn(n, generator=g, dtype=F64),
        adv=torch.randn(n, generator=g, dtype=F64),
        ref=old + 0.2 * torch.randn(n, generator=g, dtype=F64),
        rollout=old + 0.15 * torch.randn(n, generator=g, dtype=F64),
        entropy=2 * torch.rand(n, generator=g, dtype=F64),
    )
    t |= {k: torch.as_tensor(v, dtype=F64) for k, v in fixed.items()}
    t["logp"] = t["logp"].clone().requires_grad_()
    t["entropy"] = t["entropy"].clone().requires_grad_()
    return Batch(list(lengths), **t)


def grads(loss, b: Batch):
    return torch.autograd.grad(loss, (b.logp, b.entropy), allow_unused=True, materialize_grads=True)


# ---------------------------------------------------------------------------------------------
# The loop reference


def ref_aggregate(per_seq, agg, norm):
    """per_seq: a list (sequences) of lists (tokens) of scalars."""
    if agg == "token-mean":
        return sum(sum(seq) for seq in per_seq) / norm.num_tokens
    if agg == "seq-mean-token-mean":
        return sum(sum(seq) / len(seq) for seq in per_seq) / norm.num_seqs
    if agg == "seq-mean-token-sum":
        return sum(sum(seq) for seq in per_seq) / norm.num_seqs
    assert agg == "seq-mean-token-sum-norm"
    return sum(sum(seq) for seq in per_seq) / (norm.num_seqs * norm.constant)


def ref_kl(lp, ref, kl_type):
    d = lp - ref
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return d * d / 2
    x = ref - lp
    x = 20.0 + 0 * x if x > 20 else (-20.0 + 0 * x if x < -20 else x)
    v = torch.exp(x) - x - 1
    return 10.0 + 0 * v if v > 10 else v


def num(x) -> float:
    return x.item() if isinstance(x, torch.Tensor) else float(x)


def ref_token(cfg, lp, old, a, seq_ratio, stats):
    """One token's policy term; seq_ratio is GSPO's detached s_i (unused by other kinds)."""
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    r = torch.exp(lp - old)
    if cfg.kind == "pg":
        stats["ratio"].append(r.item())
        return -a * lp
    if cfg.kind == "cispo":
        stats["ratio"].append(r.item())
        w = hi if r.item() > hi else (lo if r.item() < lo else r.item())
        stats["clipped"] += int(r.item() > hi or r.item() < lo)
        return -w * a * lp
    if cfg.kind == "gspo":
        r = seq_ratio * torch.exp(lp - lp.detach())
    stats["ratio"].append(r.item())
    r_clip = hi if r.item() > hi else (lo if r.item() < lo else r)
    unclipped, clipped = -a * r, -a * r_clip
    if num(clipped) > num(unclipped):
        stats["clipped"] += 1
        loss = clipped + 0 * lp
    else:
        loss = unclipped
    if cfg.dual_clip is not None and a < 0 and num(loss) > -a * cfg.dual_clip:
        stats["dual"] += 1
        loss = -a * cfg.dual_clip + 0 * lp
    return loss


def ref_policy_loss(b: Batch, cfg: PolicyLossConfig):
    """(loss, metrics) of the whole batch, one sequence and one token at a time."""
    norm = b.norm()
    stats = dict(ratio=[], clipped=0, dual=0, masked=0, pg=0.0, w=[])
    pg, kl, ent = [], [], []
    for s, length in enumerate(b.lengths):
        toks = range(b.offset(s), b.offset(s) + length)
        seq_ratio = torch.exp(sum(b.logp[t] - b.old[t] for t in toks) / length).detach()
        geo = math.exp(sum((b.old[t] - b.rollout[t]).item() for t in toks) / length)
        seq_keep = cfg.seq_mask_geo is None or cfg.seq_mask_geo[0] <= geo <= cfg.seq_mask_geo[1]
        pg.append([])
        for t in toks:
            term = ref_token(cfg, b.logp[t], b.old[t].item(), b.adv[t].item(), seq_ratio, stats)
            w = math.exp(b.old[t].item() - b.rollout[t].item())
            stats["w"].append(w)
            if cfg.tis_cap is not None:
                term = term * min(w, cfg.tis_cap)
            tok_keep = cfg.icepop is None or cfg.icepop[0] <= w <= cfg.icepop[1]
            if not (tok_keep and seq_keep):
                stats["masked"] += 1
                term = 0 * term
            stats["pg"] += term.item()
            pg[-1].append(term)
        kl.append([ref_kl(b.logp[t], b.ref[t].item(), cfg.kl_type) for t in toks])
        ent.append([b.entropy[t] for t in toks])
    loss = ref_aggregate(pg, cfg.agg, norm)
    loss = loss + cfg.kl_coef * ref_aggregate(kl, cfg.agg, norm)
    loss = loss - cfg.entropy_coef * ref_aggregate(ent, cfg.agg, norm)
    metrics = {
        "pg_loss": stats["pg"], "clip_frac": stats["clipped"], "dual_clip_frac": stats["dual"],
        "ratio_mean": sum(stats["ratio"]), "ratio_max": max(stats["ratio"]),
        "ratio_min": min(stats["ratio"]), "masked_frac": stats["masked"],
        "is_weight_mean": sum(stats["w"]), "is_weight_max": max(stats["w"]),
        "is_weight_min": min(stats["w"]),
        "kl": sum(sum(x.item() for x in seq) for seq in kl),
        "approx_kl": sum(0.5 * (b.logp[t] - b.old[t]).item() ** 2 for t in range(len(b.old))),
    }
    return loss, metrics


VARIANTS = {
    "ppo": dict(kind="ppo"),
    "ppo-dual-cliphigher": dict(kind="ppo", eps_high=0.28, dual_clip=1.3),
    "gspo": dict(kind="gspo", eps_low=0.08, eps_high=0.1),
    "gspo-dual": dict(kind="gspo", eps_low=0.08, eps_high=0.1, dual_clip=1.1),
    "cispo": dict(kind="cispo", eps_low=0.1, eps_high=0.2),
    "pg": dict(kind="pg"),
    "ppo-k1-entropy": dict(kind="ppo", kl_coef=0.1, kl_type="k1", entropy_coef=0.01),
    "cispo-k2": dict(kind="cispo", kl_coef=0.2, kl_type="k2"),
    "gspo-k3": dict(kind="gspo", kl_coef=0.05, kl_type="k3", entropy_coef=0.02),
    "ppo-tis": dict(kind="ppo", tis_cap=1.05),
    "pg-icepop": dict(kind="pg", icepop=(0.9, 1.1)),
    "ppo-seqmask": dict(kind="ppo", seq_mask_geo=(0.95, 1.05)),
    "cispo-all-corrections": dict(kind="cispo", tis_cap=1.1, icepop=(0.8, 1.25),
                                  seq_mask_geo=(0.9, 1.1), kl_coef=0.1, entropy_coef=0.01),
}
LENGTHS = {"mixed": [3, 1, 5, 2, 4, 1], "one-token": [1, 1, 1, 1, 1]}


def seed_of(variant: str, lengths: str) -> int:
    """A fixed seed per case (str hashes change between processes)."""
    return list(VARIANTS).index(variant) * len(LENGTHS) + list(LENGTHS).index(lengths)


# ---------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("agg", AGGS)
def test_aggregate_matches_loops(agg):
    b = make_batch(LENGTHS["mixed"])
    inp, norm = b.inputs(), b.norm()
    x = b.logp * b.adv
    per_seq = [[x[t] for t in range(b.offset(s), b.offset(s) + n)] for s, n in enumerate(b.lengths)]
    want = ref_aggregate(per_seq, agg, norm)
    torch.testing.assert_close(aggregate(x, inp, norm, agg), want, **TOL)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_policy_loss_matches_reference(variant, agg, lengths):
    b = make_batch(LENGTHS[lengths], seed=seed_of(variant, lengths))
    cfg = PolicyLossConfig(agg=agg, **VARIANTS[variant])
    out = policy_loss(b.inputs(), b.norm(), cfg)
    want, want_metrics = ref_policy_loss(b, cfg)
    torch.testing.assert_close(out.loss, want, **TOL)
    for got_g, want_g in zip(grads(out.loss, b), grads(want, b), strict=True):
        torch.testing.assert_close(got_g, want_g, **TOL)
    for key, value in want_metrics.items():
        torch.testing.assert_close(out.metrics[key], torch.tensor(value, dtype=F64), **TOL)


def test_reference_variants_exercise_every_branch():
    """The random batches above do clip, dual-clip and mask tokens (else matching proves little)."""
    seen = {"clip_frac": 0, "dual_clip_frac": 0, "masked_frac": 0}
    for variant, kw in VARIANTS.items():
        for lengths in LENGTHS:
            b = make_batch(LENGTHS[lengths], seed=seed_of(variant, lengths))
            _, metrics = ref_policy_loss(b, PolicyLossConfig(**kw))
            for key in seen:
                seen[key] += metrics[key]
    assert all(v > 0 for v in seen.values()), seen


# ---------------------------------------------------------------------------------------------
# The key invariant: micro-batches at sequence boundaries sum to the mini-batch


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_micro_batch_split_sums_to_one_batch(variant, agg):
    b = make_batch([3, 1, 5, 2, 4, 1, 2], seed=7)
    cfg = PolicyLossConfig(agg=agg, **VARIANTS[variant])
    whole = policy_loss(b.inputs(), b.norm(), cfg)
    # Uneven micro-batches, including an empty one (a rank with no loss tokens).
    parts = [policy_loss(b.inputs(s0, s1), b.norm(), cfg)
             for s0, s1 in [(0, 2), (2, 3), (3, 3), (3, 6), (6, 7)]]
    split = sum(p.loss for p in parts)
    torch.testing.assert_close(split, whole.loss, **TOL)
    for got_g, want_g in zip(grads(split, b), grads(whole.loss, b), strict=True):
        torch.testing.assert_close(got_g, want_g, **TOL)
    assert set(whole.metrics) == set(parts[0].metrics) == set(parts[2].metrics)
    for key, value in whole.metrics.items():
        reduce = max if key.endswith("_max") else min if key.endswith("_min") else sum
        torch.testing.assert_close(reduce(p.metrics[key] for p in parts), value, **TOL)


# ---------------------------------------------------------------------------------------------
# Edge cases with hand-computed values


@pytest.mark.parametrize("variant", ["ppo", "ppo-dual-cliphigher", "gspo", "cispo", "pg"])
def test_zero_advantages_give_zero_loss_and_gradient(variant):
    b = make_batch([3, 1, 4], adv=torch.zeros(8))
    for agg in AGGS:
        out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(agg=agg, **VARIANTS[variant]))
        assert out.loss.item() == 0
        assert torch.all(grads(out.loss, b)[0] == 0)


def test_ppo_all_tokens_clipped_has_zero_gradient():
    # A > 0 with r = 1.5 > 1.2 and A < 0 with r = 0.5 < 0.8: the clipped branch wins everywhere.
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5], dtype=F64)
    adv = torch.tensor([1.0, 2.0, -1.0, -3.0], dtype=F64)
    old = torch.full((4,), -1.0, dtype=F64)
    b = make_batch([2, 2], old=old, logp=old + ratio.log(), adv=adv)
    out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(kind="ppo"))
    want = (-1.0 * 1.2 - 2.0 * 1.2 + 1.0 * 0.8 + 3.0 * 0.8) / 4
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    assert torch.all(grads(out.loss, b)[0] == 0)
    assert out.metrics["clip_frac"].item() == 4


def test_dual_clip_caps_negative_advantages_with_zero_gradient():
    ratio = torch.tensor([5.0, 2.0, 0.5], dtype=F64)
    old = torch.full((3,), -2.0, dtype=F64)
    b = make_batch([3], old=old, logp=old + ratio.log(), adv=-torch.ones(3))
    out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(kind="ppo", dual_clip=3.0))
    # r=5: -A r = 5 capped at -A c = 3; r=2: unclipped 2 (< 3); r=0.5: clipped -A*0.8.
    assert out.loss.item() == pytest.approx((3.0 + 2.0 + 0.8) / 3, abs=1e-12)
    torch.testing.assert_close(grads(out.loss, b)[0], torch.tensor([0.0, 2 / 3, 0.0], dtype=F64),
                               **TOL)
    assert out.metrics["dual_clip_frac"].item() == 1
    assert out.metrics["clip_frac"].item() == 1


@pytest.mark.parametrize("eps_high, clipped", [(0.28, False), (0.2, True)])
def test_clip_higher_asymmetry(eps_high, clipped):
    b = make_batch([1], old=[-1.0], logp=[-1.0 + math.log(1.25)], adv=[1.0])
    out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(eps_low=0.2, eps_high=eps_high))
    assert out.metrics["clip_frac"].item() == int(clipped)
    assert out.loss.item() == pytest.approx(-1.2 if clipped else -1.25, abs=1e-12)
    assert grads(out.loss, b)[0].item() == pytest.approx(0.0 if clipped else -1.25, abs=1e-12)


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_on_one_token_sequences_equals_ppo(agg):
    b = make_batch([1, 1, 1, 1, 1, 1], seed=3)
    kw = dict(agg=agg, eps_low=0.1, eps_high=0.15, dual_clip=1.2)
    gspo = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(kind="gspo", **kw))
    ppo = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(kind="ppo", **kw))
    torch.testing.assert_close(gspo.loss, ppo.loss, **TOL)
    torch.testing.assert_close(grads(gspo.loss, b)[0], grads(ppo.loss, b)[0], **TOL)
    for key in ppo.metrics:
        torch.testing.assert_close(gspo.metrics[key], ppo.metrics[key], **TOL)
    assert ppo.metrics["clip_frac"].item() > 0


def test_gspo_ratio_is_shared_by_all_tokens_of_a_sequence():
    b = make_batch([5], seed=4, adv=torch.full((5,), 0.7, dtype=F64))
    # Wide clip range: no token clipped, so every token's gradient is -A * s / N.
    cfg = PolicyLossConfig(kind="gspo", eps_low=10.0, eps_high=10.0)
    out = policy_loss(b.inputs(), b.norm(), cfg)
    s = torch.exp((b.logp - b.old).mean()).detach()
    assert out.metrics["ratio_max"].item() == pytest.approx(s.item(), abs=1e-12)
    assert out.metrics["ratio_min"].item() == pytest.approx(s.item(), abs=1e-12)
    assert out.metrics["ratio_mean"].item() == pytest.approx(5 * s.item(), abs=1e-12)
    want = torch.full((5,), -0.7 * s.item() / 5, dtype=F64)
    torch.testing.assert_close(grads(out.loss, b)[0], want, **TOL)


def test_cispo_gradient_is_clipped_weight_times_advantage():
    ratio = torch.tensor([0.5, 0.95, 1.1, 1.6], dtype=F64)
    adv = torch.tensor([1.0, -2.0, 0.5, -1.5], dtype=F64)
    old = torch.full((4,), -1.5, dtype=F64)
    b = make_batch([1, 3], old=old, logp=old + ratio.log(), adv=adv)
    out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(kind="cispo", eps_low=0.1,
                                                             eps_high=0.2))
    w = torch.tensor([0.9, 0.95, 1.1, 1.2], dtype=F64)  # clip(r, 0.9, 1.2)
    torch.testing.assert_close(grads(out.loss, b)[0], -w * adv / 4, **TOL)
    assert out.metrics["clip_frac"].item() == 2  # r = 0.5 and r = 1.6


@pytest.mark.parametrize("variant", ["ppo", "ppo-dual-cliphigher", "gspo", "cispo", "pg"])
def test_on_policy_ratio_is_exactly_one(variant):
    b = make_batch([2, 3, 1], seed=5)
    b.logp = b.old.clone().requires_grad_()
    out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(**VARIANTS[variant]))
    assert out.metrics["ratio_max"].item() == 1.0 and out.metrics["ratio_min"].item() == 1.0
    assert out.metrics["ratio_mean"].item() == 6.0
    assert out.metrics["clip_frac"].item() == 0 and out.metrics["approx_kl"].item() == 0


# ---------------------------------------------------------------------------------------------
# Train-inference mismatch corrections


def test_tis_weight_is_capped_and_detached():
    b = make_batch([2, 2], seed=6)
    cfg = PolicyLossConfig(kind="pg", tis_cap=1.02)
    out = policy_loss(b.inputs(), b.norm(), cfg)
    w = torch.exp(b.old - b.rollout)
    assert (w > 1.02).any() and (w < 1.02).any()
    torch.testing.assert_close(grads(out.loss, b)[0], -b.adv * w.clamp(max=1.02) / 4, **TOL)
    # The IS-weight metrics are of the weight before capping.
    assert out.metrics["is_weight_max"].item() == pytest.approx(w.max().item(), abs=1e-12)
    assert out.metrics["is_weight_mean"].item() == pytest.approx(w.sum().item(), abs=1e-12)


def test_icepop_zeroes_tokens_outside_the_band_but_keeps_the_normaliser():
    old = torch.full((4,), -1.0, dtype=F64)
    w = torch.tensor([0.5, 1.0, 1.1, 3.0], dtype=F64)  # exp(old - rollout)
    b = make_batch([4], old=old, logp=old, rollout=old - w.log(), adv=torch.ones(4))
    out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(kind="pg", icepop=(0.8, 1.2)))
    keep = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=F64)
    assert out.loss.item() == pytest.approx((-b.old * keep).sum().item() / 4, abs=1e-12)
    torch.testing.assert_close(grads(out.loss, b)[0], -keep / 4, **TOL)
    assert out.metrics["masked_frac"].item() == 2


def test_sequence_mask_drops_whole_sequences():
    old = torch.full((5,), -1.0, dtype=F64)
    # Sequence 0 (3 tokens): geometric mean of w is exp(mean(log [1.5, 1.5, 1.0])) ~ 1.31: dropped.
    # Sequence 1 (2 tokens): w = [1.5, 0.7], geometric mean ~ 1.02: kept although each token
    # alone is far from 1 (the sequence mask looks at the geometric mean only).
    w = torch.tensor([1.5, 1.5, 1.0, 1.5, 0.7], dtype=F64)
    b = make_batch([3, 2], old=old, logp=old, rollout=old - w.log(), adv=torch.ones(5))
    out = policy_loss(b.inputs(), b.norm(), PolicyLossConfig(kind="pg", seq_mask_geo=(0.9, 1.1)))
    torch.testing.assert_close(grads(out.loss, b)[0],
                               torch.tensor([0, 0, 0, -0.2, -0.2], dtype=F64), **TOL)
    assert out.metrics["masked_frac"].item() == 3


@pytest.mark.parametrize("key, value", [("tis_cap", 2.0), ("icepop", (0.5, 2.0)),
                                        ("seq_mask_geo", (0.5, 2.0))])
def test_corrections_without_rollout_logprobs_raise_one_line(key, value):
    b = make_batch([2])
    inp = b.inputs()
    inp.rollout_logprobs = None
    with pytest.raises(ValueError) as err:
        policy_loss(inp, b.norm(), PolicyLossConfig(**{key: value}))
    assert "\n" not in str(err.value) and key in str(err.value)
    assert "rollout_logprobs" in str(err.value)


# ---------------------------------------------------------------------------------------------
# KL and entropy


def test_kl_estimator_values():
    logp = torch.tensor([0.0, -0.5, 0.0, 0.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([0.0, -1.0, 30.0, -30.0], dtype=F64)  # d = 0, 0.5, -30, 30
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"),
                               torch.tensor([0.0, 0.5, -30.0, 30.0], dtype=F64), **TOL)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"),
                               torch.tensor([0.0, 0.125, 450.0, 450.0], dtype=F64), **TOL)
    k3 = kl_estimate(logp, ref, "k3")
    # exp(-0.5) - 1 + 0.5; both far tokens hit the [-10, 10] clamp (and get no gradient).
    torch.testing.assert_close(k3, torch.tensor([0.0, math.exp(-0.5) - 0.5, 10.0, 10.0],
                                                dtype=F64), **TOL)
    (g,) = torch.autograd.grad(k3.sum(), logp)
    torch.testing.assert_close(g, torch.tensor([0.0, 1 - math.exp(-0.5), 0.0, 0.0], dtype=F64),
                               **TOL)


def test_kl_and_entropy_terms_are_added_with_their_coefficients():
    b = make_batch([2, 3], seed=8)
    inp, norm = b.inputs(), b.norm()
    base = policy_loss(inp, norm, PolicyLossConfig(agg="seq-mean-token-mean"))
    cfg = PolicyLossConfig(agg="seq-mean-token-mean", kl_coef=0.3, kl_type="k2",
                           entropy_coef=0.05)
    full = policy_loss(inp, norm, cfg)
    kl = aggregate(0.5 * (b.logp - b.ref) ** 2, inp, norm, cfg.agg)
    ent = aggregate(b.entropy, inp, norm, cfg.agg)
    torch.testing.assert_close(full.loss, base.loss + 0.3 * kl - 0.05 * ent, **TOL)
    (g_ent,) = torch.autograd.grad(full.loss, b.entropy)
    torch.testing.assert_close(g_ent, torch.tensor([-0.05 / 2 / 2] * 2 + [-0.05 / 3 / 2] * 3,
                                                   dtype=F64), **TOL)


@pytest.mark.parametrize("key, field, cfg", [
    ("kl_coef", "ref_logprobs", dict(kl_coef=0.1)),
    ("entropy_coef", "entropy", dict(entropy_coef=0.1)),
])
def test_kl_or_entropy_without_their_inputs_raise_one_line(key, field, cfg):
    b = make_batch([2])
    inp = b.inputs()
    setattr(inp, field, None)
    with pytest.raises(ValueError) as err:
        policy_loss(inp, b.norm(), PolicyLossConfig(**cfg))
    assert "\n" not in str(err.value) and key in str(err.value) and field in str(err.value)


# ---------------------------------------------------------------------------------------------
# Empty micro-batches, dtypes, the callable, validation


def test_empty_micro_batch_is_zero_connected_and_neutral():
    b = make_batch([2, 3])
    cfg = PolicyLossConfig(kind="gspo", tis_cap=2.0, kl_coef=0.1, entropy_coef=0.1)
    out = policy_loss(b.inputs(1, 1), b.norm(), cfg)
    assert out.loss.item() == 0 and out.loss.requires_grad
    assert torch.all(grads(out.loss, b)[0] == 0)
    for key, value in out.metrics.items():
        want = -math.inf if key.endswith("_max") else math.inf if key.endswith("_min") else 0.0
        assert value.item() == want, key


def test_float32_stays_float32_and_metrics_are_float64_detached():
    b = make_batch([2, 3], seed=9)
    inp32 = b.inputs()
    for name in ("logprobs", "old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs",
                 "entropy"):
        setattr(inp32, name, getattr(inp32, name).float())
    cfg = PolicyLossConfig(kind="ppo", kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    out32 = policy_loss(inp32, b.norm(), cfg)
    out64 = policy_loss(b.inputs(), b.norm(), cfg)
    assert out32.loss.dtype == torch.float32 and out64.loss.dtype == F64
    assert all(m.dtype == F64 and not m.requires_grad for m in out32.metrics.values())
    # float32 eps ~1.2e-7 over a handful of O(1) terms: 1e-5 is ample, a formula bug is not.
    torch.testing.assert_close(out32.loss.double(), out64.loss, atol=1e-5, rtol=1e-5)


def test_low_precision_logprobs_are_refused():
    b = make_batch([2])
    inp = b.inputs()
    inp.logprobs = inp.logprobs.bfloat16()
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(inp, b.norm(), PolicyLossConfig())


def test_make_loss_is_the_user_loss_signature():
    b = make_batch([3, 2], seed=10)
    cfg = PolicyLossConfig(kind="cispo", agg="seq-mean-token-sum-norm")
    loss_fn = make_loss(cfg)
    got, want = loss_fn(b.inputs(), b.norm()), policy_loss(b.inputs(), b.norm(), cfg)
    assert torch.equal(got.loss, want.loss) and got.metrics.keys() == want.metrics.keys()


@pytest.mark.parametrize("key, kw", [
    ("kind", dict(kind="sac")),
    ("agg", dict(agg="mean")),
    ("kl_type", dict(kl_type="k4")),
    ("eps_low", dict(eps_low=-0.1)),
    ("eps_high", dict(eps_high=-1.0)),
    ("dual_clip", dict(dual_clip=1.0)),
    ("dual_clip", dict(kind="cispo", dual_clip=3.0)),
    ("kl_coef", dict(kl_coef=-0.1)),
    ("entropy_coef", dict(entropy_coef=-0.01)),
    ("tis_cap", dict(tis_cap=0.0)),
    ("icepop", dict(icepop=(2.0, 0.5))),
    ("icepop", dict(icepop=(-1.0, 2.0))),
    ("seq_mask_geo", dict(seq_mask_geo=(1.2, 0.8))),
])
def test_config_validation_is_one_line_naming_the_key(key, kw):
    with pytest.raises(ValueError) as err:
        make_loss(PolicyLossConfig(**kw))
    assert "\n" not in str(err.value) and f"PolicyLossConfig.{key}" in str(err.value)


def test_normalizers_smaller_than_the_micro_batch_are_refused():
    b = make_batch([2, 3])
    with pytest.raises(ValueError) as err:
        policy_loss(b.inputs(), Normalizers(num_tokens=2, num_seqs=2), PolicyLossConfig())
    assert "\n" not in str(err.value) and "Normalizers" in str(err.value)
