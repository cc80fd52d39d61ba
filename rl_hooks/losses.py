"""Policy-update losses: pure functions of a micro-batch's per-token tensors and global normalisers.

Legend: N loss (response) tokens of one micro-batch, flattened in sequence order; S sequences of
that micro-batch with at least one loss token (`LossInputs.num_seqs_local`).

The normalisation contract. A trainer calls the loss once per micro-batch; sequences are never
split across micro-batches, so every per-sequence quantity (its token count T_s, its mean log-ratio)
is local. `Normalizers` hold counts of the whole mini-batch summed over data-parallel ranks,
computed once per optimizer step, and every returned loss is a sum over this micro-batch's tokens
or sequences divided by those counts. Summing `LossOutput.loss` over micro-batches and ranks
therefore gives the mini-batch loss exactly, whatever the split (never a mean per micro-batch,
which would weight short micro-batches up).

    loss_fn = make_loss(PolicyLossConfig(kind="ppo", agg="token-mean", eps_high=0.28))
    out = loss_fn(LossInputs(logp_N, old_N, adv_N, seq_index_N, num_seqs_local), norm)
    out.loss.backward()

Numerics: everything is computed in the dtype of `logprobs` (float32 or float64); metrics are
upcast to float64 before they are reduced. Log-ratios are clamped to [-20, 20] before `exp`, as
verl's compute_policy_loss does: exp(89) overflows float32, and a token that far off-policy gets no
gradient rather than an inf.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

KINDS = ("ppo", "gspo", "cispo", "pg")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: finite in float32, far past any clip range
# (log-ratio, value) bounds of each KL estimator when PolicyLossConfig leaves them unset: k3 as
# verl's low_var_kl bounds it (the value cap keeps a few far-off tokens from dominating).
KL_CLAMPS = {"k1": (math.inf, math.inf), "k2": (math.inf, math.inf),
             "k3": (LOG_RATIO_CLAMP, 10.0)}


@dataclass
class LossInputs:
    """One micro-batch: the N loss tokens of whole sequences, in sequence order.

    logprobs [N] float32/float64 with grad (current policy); old_logprobs [N] (behaviour policy,
    recomputed by the trainer, no grad); advantages [N]; seq_index [N] int64, non-decreasing in
    0..num_seqs_local-1. Optional [N]: ref_logprobs (reference policy, for KL), rollout_logprobs
    (the sampler's, for train-inference mismatch corrections), entropy (with grad, for the bonus).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    seq_index: Tensor
    num_seqs_local: int
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    entropy: Tensor | None = None


@dataclass
class Normalizers:
    """Counts of the whole mini-batch, summed over data-parallel ranks."""

    num_tokens: int  # loss tokens
    num_seqs: int  # sequences with >= 1 loss token
    constant: float = 1.0  # the fixed length C of seq-mean-token-sum-norm (Dr.GRPO's MAX_TOKENS)


@dataclass
class LossOutput:
    """`loss`: scalar with grad, this micro-batch's share of the mini-batch loss.

    `metrics`: detached float64 scalars. Keys ending in "_max" reduce by max and "_min" by min;
    every other key is a SUM over tokens that the trainer divides by `Normalizers.num_tokens`
    after summing over micro-batches and ranks.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[[LossInputs, Normalizers], LossOutput]


@dataclass
class PolicyLossConfig:
    """The built-in policy loss. Policy terms per token, r = exp(logp - old), A = advantage:

    ppo   max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); with dual_clip c, A < 0 tokens are capped
          at -A c (Dual-clip PPO, Ye et al. 2020).
    gspo  the same with the sequence ratio s = exp(mean_t(logp - old)) in its token form
          sg(s) * exp(logp - sg(logp)) (Zheng et al. 2025); the paper's eps are ~3e-4 / 4e-4.
    cispo -sg(clip(r, 1-eps_low, 1+eps_high)) * A * logp (MiniMax-M1, 2025): the IS weight is
          clipped and detached, so every token keeps a gradient. MiniMax clips only the upper
          side; set eps_low >= 1 to disable the lower bound (ratios are > 0).
    pg    -A * logp (REINFORCE); ignores eps_low/eps_high.
    """

    kind: str = "ppo"  # ppo | gspo | cispo | pg
    agg: str = "token-mean"  # see `aggregate`
    eps_low: float = 0.2  # ratio clipped to [1 - eps_low, 1 + eps_high] (clip-higher, DAPO)
    eps_high: float = 0.2
    dual_clip: float | None = None  # c > 1; ppo and gspo only
    kl_coef: float = 0.0  # loss += kl_coef * aggregate(kl_N); needs ref_logprobs
    kl_type: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(policy || ref))
    # Bounds of the KL estimate: the log-ratio ref - logp is clamped to +-kl_log_ratio_clamp and
    # the estimate to +-kl_value_clamp (no gradient past either bound). None = the estimator's
    # usual bounds: k3 20 / 10 (verl's low_var_kl), k1 and k2 unbounded; inf = unbounded.
    kl_log_ratio_clamp: float | None = None
    kl_value_clamp: float | None = None
    # True adds the score-function term kl * d(logp) to the KL gradient (the value is unchanged):
    # the KL is estimated on tokens sampled from the policy being optimised. NeMo-RL's ClippedPG
    # loss does this (the estimate times exp(logp - sg(logp))); verl's kl loss does not.
    kl_score_grad: bool = False
    entropy_coef: float = 0.0  # loss -= entropy_coef * aggregate(entropy_N); needs entropy
    # Train-inference mismatch corrections; each needs rollout_logprobs. The IS weight is
    # w = exp(old - rollout).
    tis_cap: float | None = None  # truncated IS: the policy term is multiplied by sg(min(w, cap))
    icepop: tuple[float, float] | None = None  # IcePop: tokens with w outside [a, b] get no PG loss
    # Sequences whose geometric-mean weight exp(mean_t log w) is outside [a, b] get no PG loss.
    seq_mask_geo: tuple[float, float] | None = None

    def validate(self) -> None:
        """Raise ValueError with a one-line message naming the key and the fix."""
        _check_choice("kind", self.kind, KINDS)
        _check_choice("agg", self.agg, AGGS)
        _check_choice("kl_type", self.kl_type, KL_TYPES)
        for key in ("eps_low", "eps_high", "kl_coef", "entropy_coef"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"PolicyLossConfig.{key}={value!r}: must be a finite number >= 0")
        for key in ("kl_log_ratio_clamp", "kl_value_clamp"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"PolicyLossConfig.{key}={value!r}: must be > 0 (inf for no "
                                 "bound), or None for the estimator's usual bound")
        if self.dual_clip is not None:
            if not self.dual_clip > 1:
                raise ValueError(f"PolicyLossConfig.dual_clip={self.dual_clip!r}: must be > 1 "
                                 "(the cap -A*c on negative-advantage tokens), or None to disable")
            if self.kind not in ("ppo", "gspo"):
                raise ValueError(f"PolicyLossConfig.dual_clip applies to kind ppo or gspo, not "
                                 f"{self.kind!r}: set dual_clip=None")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"PolicyLossConfig.tis_cap={self.tis_cap!r}: must be > 0, or None")
        _check_interval("icepop", self.icepop)
        _check_interval("seq_mask_geo", self.seq_mask_geo)

    @property
    def has_corrections(self) -> bool:
        return self.tis_cap is not None or self.icepop is not None or self.seq_mask_geo is not None


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"PolicyLossConfig.{key}={value!r}: choose one of {', '.join(choices)}")


def _check_interval(key: str, value: tuple[float, float] | None) -> None:
    if value is None:
        return
    if len(value) != 2 or not 0 <= value[0] <= value[1]:
        raise ValueError(f"PolicyLossConfig.{key}={value!r}: must be a pair [a, b] with "
                         "0 <= a <= b, or None to disable")


def make_loss(cfg: PolicyLossConfig) -> LossFn:
    """Validate `cfg` once; return `policy_loss` as a `(LossInputs, Normalizers) -> LossOutput`."""
    cfg.validate()
    return functools.partial(policy_loss, cfg=cfg)


# ---------------------------------------------------------------------------------------------
# Segment sums and aggregation


def _seq_sum(x_N: Tensor, inp: LossInputs) -> Tensor:
    """Per-sequence sums [S] of x_N, in x_N's dtype (index_add keeps the autograd graph)."""
    out_S = torch.zeros(inp.num_seqs_local, dtype=x_N.dtype, device=x_N.device)
    return out_S.index_add(0, inp.seq_index, x_N)


def _seq_mean(x_N: Tensor, inp: LossInputs) -> Tensor:
    """Per-sequence means [S]; a sequence without tokens (not expected) gets 0, not 0/0."""
    len_S = _seq_sum(torch.ones_like(x_N), inp).clamp(min=1)
    return _seq_sum(x_N, inp) / len_S


def aggregate(loss_N: Tensor, inp: LossInputs, norm: Normalizers, agg: str) -> Tensor:
    """Reduce per-token values loss_N [N] to this micro-batch's share of the mini-batch value.

    T_s is sequence s's loss-token count (local: sequences are whole), so with global normalisers
    the shares of all micro-batches and ranks sum to the mini-batch value:
      token-mean              sum_N l / num_tokens
      seq-mean-token-mean     sum_s (sum_{t in s} l / T_s) / num_seqs
      seq-mean-token-sum      sum_s sum_{t in s} l / num_seqs
      seq-mean-token-sum-norm sum_N l / (num_seqs * constant)   (Dr.GRPO, constant fixed)
    Returns a scalar in loss_N's dtype.
    """
    _check_choice("agg", agg, AGGS)
    _check_normalizers(inp, norm, loss_N.shape[0])
    # A zero normaliser only happens for an all-empty mini-batch, whose sum is 0: 1 avoids 0/0.
    if agg == "token-mean":
        return loss_N.sum() / max(norm.num_tokens, 1)
    if agg == "seq-mean-token-mean":
        return _seq_mean(loss_N, inp).sum() / max(norm.num_seqs, 1)
    if agg == "seq-mean-token-sum":
        return loss_N.sum() / max(norm.num_seqs, 1)
    return loss_N.sum() / (max(norm.num_seqs, 1) * norm.constant)


def _check_normalizers(inp: LossInputs, norm: Normalizers, n: int) -> None:
    # Python ints only: no device synchronisation.
    if not (n <= norm.num_tokens and inp.num_seqs_local <= norm.num_seqs):
        raise ValueError(f"Normalizers(num_tokens={norm.num_tokens}, num_seqs={norm.num_seqs}) "
                         f"are smaller than this micro-batch ({n} tokens, {inp.num_seqs_local} "
                         "sequences): pass mini-batch counts summed over all DP ranks")
    if not norm.constant > 0:
        raise ValueError(f"Normalizers.constant={norm.constant!r}: must be > 0 "
                         "(the fixed response length of seq-mean-token-sum-norm)")


# ---------------------------------------------------------------------------------------------
# Per-token terms


def _exp_clamped(log_x: Tensor) -> Tensor:
    return torch.exp(log_x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clipped_surrogate(ratio_N: Tensor, adv_N: Tensor, cfg: PolicyLossConfig):
    """PPO's pessimistic surrogate [N] with the clipped / dual-clipped indicators [N] (bool).

    `where` (not max/min) routes the whole gradient to the active branch; when the clipped branch
    is strictly active the ratio lies outside the clip range, so that gradient is zero.
    """
    unclipped_N = -adv_N * ratio_N
    clipped_N = -adv_N * ratio_N.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    is_clipped_N = clipped_N > unclipped_N
    loss_N = torch.where(is_clipped_N, clipped_N, unclipped_N)
    if cfg.dual_clip is None:
        return loss_N, is_clipped_N, torch.zeros_like(is_clipped_N)
    cap_N = -adv_N * cfg.dual_clip  # constant in the policy: no gradient where it is active
    is_dual_N = (adv_N < 0) & (cap_N < loss_N)
    return torch.where(is_dual_N, cap_N, loss_N), is_clipped_N, is_dual_N


def _gspo_ratio(logp_N: Tensor, log_ratio_N: Tensor, inp: LossInputs) -> Tensor:
    """GSPO's token-form ratio [N]: value s_i of the token's sequence, d/dlogp_t = s_i."""
    log_s_S = _seq_mean(log_ratio_N.detach(), inp)
    return _exp_clamped(log_s_S)[inp.seq_index] * torch.exp(logp_N - logp_N.detach())


def _policy_term(logp_N: Tensor, old_N: Tensor, adv_N: Tensor, inp: LossInputs,
                 cfg: PolicyLossConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token policy loss [N], the ratio reported in metrics [N] (detached), and the clipped
    and dual-clipped indicators [N] (bool)."""
    log_ratio_N = logp_N - old_N
    ratio_N = _exp_clamped(log_ratio_N)
    no_clip_N = torch.zeros_like(adv_N, dtype=torch.bool)
    if cfg.kind == "ppo":
        loss_N, clipped_N, dual_N = _clipped_surrogate(ratio_N, adv_N, cfg)
    elif cfg.kind == "gspo":
        ratio_N = _gspo_ratio(logp_N, log_ratio_N, inp)
        loss_N, clipped_N, dual_N = _clipped_surrogate(ratio_N, adv_N, cfg)
    elif cfg.kind == "cispo":
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
        weight_N = ratio_N.detach().clamp(lo, hi)
        loss_N = -weight_N * adv_N * logp_N
        clipped_N, dual_N = (ratio_N < lo) | (ratio_N > hi), no_clip_N
    else:
        loss_N, clipped_N, dual_N = -adv_N * logp_N, no_clip_N, no_clip_N
    return loss_N, ratio_N.detach(), clipped_N, dual_N


def _corrections(old_N: Tensor, rollout_N: Tensor, inp: LossInputs, cfg: PolicyLossConfig):
    """Train-inference mismatch corrections from the IS weight w = exp(old - rollout).

    Returns w [N] (uncapped, detached), the TIS weight [N] or None, and the kept-token mask [N]
    (bool, True where neither IcePop nor the sequence mask drops the token).
    """
    log_w_N = (old_N - rollout_N).detach()
    w_N = _exp_clamped(log_w_N)
    tis_N = w_N.clamp(max=cfg.tis_cap) if cfg.tis_cap is not None else None
    keep_N = torch.ones_like(w_N, dtype=torch.bool)
    if cfg.icepop is not None:
        keep_N &= (w_N >= cfg.icepop[0]) & (w_N <= cfg.icepop[1])
    if cfg.seq_mask_geo is not None:
        geo_S = _exp_clamped(_seq_mean(log_w_N, inp))
        keep_S = (geo_S >= cfg.seq_mask_geo[0]) & (geo_S <= cfg.seq_mask_geo[1])
        keep_N &= keep_S[inp.seq_index]
    return w_N, tis_N, keep_N


def kl_estimate(logp_N: Tensor, ref_N: Tensor, kl_type: str, log_ratio_clamp: float | None = None,
                value_clamp: float | None = None, score_grad: bool = False) -> Tensor:
    """Schulman's per-token estimators [N] of KL(policy || ref), d = logp - ref, in logp's dtype.

    k1 = d; k2 = d^2 / 2; k3 = exp(-d) - 1 + d. -d is clamped to +-log_ratio_clamp (exp overflow)
    and the estimate to +-value_clamp (a few far-off tokens would otherwise dominate the penalty
    and its gradient); None takes the estimator's usual bounds, `KL_CLAMPS` (k3 as verl's
    low_var_kl: 20 and 10). `score_grad` multiplies the estimate by exp(logp - sg(logp)), 1 in
    value, which adds kl * d(logp) to the gradient; a token whose log-ratio was clamped gets none.
    """
    _check_choice("kl_type", kl_type, KL_TYPES)
    in_clamp, out_clamp = KL_CLAMPS[kl_type]
    in_clamp = in_clamp if log_ratio_clamp is None else log_ratio_clamp
    out_clamp = out_clamp if value_clamp is None else value_clamp
    neg_d_N = ref_N - logp_N
    clamped_N = None
    if math.isfinite(in_clamp):
        bounded_N = neg_d_N.clamp(-in_clamp, in_clamp)
        clamped_N = bounded_N != neg_d_N
        neg_d_N = bounded_N
    if kl_type == "k1":
        kl_N = -neg_d_N
    elif kl_type == "k2":
        kl_N = 0.5 * neg_d_N.square()
    else:
        kl_N = torch.exp(neg_d_N) - neg_d_N - 1
    if score_grad:
        w_N = torch.exp(logp_N - logp_N.detach())
        if clamped_N is not None:
            w_N = torch.where(clamped_N, w_N.detach(), w_N)
        kl_N = w_N * kl_N
    if math.isfinite(out_clamp):
        kl_N = kl_N.clamp(-out_clamp, out_clamp)
    return kl_N


# ---------------------------------------------------------------------------------------------
# The loss


def _check_inputs(inp: LossInputs, cfg: PolicyLossConfig) -> None:
    dtype = inp.logprobs.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"LossInputs.logprobs has dtype {dtype}: pass float32 or float64 "
                         "log-probs (exp of a low-precision log-ratio is not a usable ratio)")
    n = inp.logprobs.shape
    if len(n) != 1:
        raise ValueError(f"LossInputs.logprobs has shape {tuple(n)}: flatten loss tokens to [N]")
    if inp.seq_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"LossInputs.seq_index has dtype {inp.seq_index.dtype}: pass int64 "
                         "sequence indices (0..num_seqs_local-1)")
    for name in ("old_logprobs", "advantages", "seq_index", "ref_logprobs", "rollout_logprobs",
                 "entropy"):
        t = getattr(inp, name)
        if t is not None and t.shape != n:
            raise ValueError(f"LossInputs.{name} has shape {tuple(t.shape)}, logprobs "
                             f"{tuple(n)}: every per-token tensor must be 1-D of the same length")
    if cfg.has_corrections and inp.rollout_logprobs is None:
        raise ValueError("PolicyLossConfig.tis_cap/icepop/seq_mask_geo need "
                         "LossInputs.rollout_logprobs: pass the sampler's log-probs or unset them")
    if cfg.kl_coef > 0 and inp.ref_logprobs is None:
        raise ValueError("PolicyLossConfig.kl_coef > 0 needs LossInputs.ref_logprobs: pass the "
                         "reference policy's log-probs or set kl_coef=0")
    if cfg.entropy_coef > 0 and inp.entropy is None:
        raise ValueError("PolicyLossConfig.entropy_coef > 0 needs LossInputs.entropy: pass the "
                         "per-token entropy or set entropy_coef=0")


def _sum64(x_N: Tensor) -> Tensor:
    return x_N.detach().to(torch.float64).sum()


def _max64(x_N: Tensor) -> Tensor:
    """Max in float64; -inf for an empty micro-batch (neutral for the max-reduction)."""
    x_N = x_N.detach().to(torch.float64)
    return x_N.max() if x_N.numel() else x_N.new_tensor(-math.inf)


def _min64(x_N: Tensor) -> Tensor:
    return -_max64(-x_N)


def _ratio_metrics(prefix: str, x_N: Tensor) -> dict[str, Tensor]:
    """Sum ("_mean": the trainer divides it by num_tokens), max and min of x_N, in float64."""
    return {f"{prefix}_mean": _sum64(x_N), f"{prefix}_max": _max64(x_N),
            f"{prefix}_min": _min64(x_N)}


def policy_loss(inp: LossInputs, norm: Normalizers, cfg: PolicyLossConfig) -> LossOutput:
    """The built-in policy loss of one micro-batch (see `PolicyLossConfig` for the terms).

    loss = aggregate(pg_N) + kl_coef * aggregate(kl_N) - entropy_coef * aggregate(entropy_N),
    a scalar in logprobs' dtype. Corrections multiply (TIS) or zero (IcePop, sequence mask) pg_N,
    but masked tokens still count in the normalisers, as in verl: the normaliser then does not
    depend on the correction, and a micro-batch's share does not depend on its neighbours'.

    Metrics (float64, detached; sums over tokens unless "_max"/"_min"): pg_loss (sum of pg_N after
    corrections, i.e. its token mean once divided by num_tokens, whatever `agg`), clip_frac
    (tokens whose clipped branch is strictly active; for cispo, tokens whose IS weight was
    clipped), dual_clip_frac, ratio_mean/_max/_min (r; gspo: its sequence ratio s per token),
    approx_kl (sum of (logp - old)^2 / 2); with entropy: entropy; with ref_logprobs: kl; with
    rollout_logprobs: is_weight_mean/_max/_min (exp(old - rollout), before capping), masked_frac,
    logprob_gap_mean (sum |old - rollout|), logprob_gap_max.

    An empty micro-batch (N == 0) returns a zero loss still connected to the graph (so every
    rank's backward reaches the same parameters) and neutral metrics: sums 0, max -inf, min +inf.
    """
    cfg.validate()
    _check_inputs(inp, cfg)
    logp_N = inp.logprobs
    old_N = inp.old_logprobs.detach().to(logp_N.dtype)
    adv_N = inp.advantages.detach().to(logp_N.dtype)

    pg_N, ratio_N, clipped_N, dual_N = _policy_term(logp_N, old_N, adv_N, inp, cfg)
    metrics: dict[str, Tensor] = {}
    if inp.rollout_logprobs is not None:
        rollout_N = inp.rollout_logprobs.to(logp_N.dtype)
        w_N, tis_N, keep_N = _corrections(old_N, rollout_N, inp, cfg)
        if tis_N is not None:
            pg_N = pg_N * tis_N
        pg_N = torch.where(keep_N, pg_N, torch.zeros_like(pg_N))
        gap_N = (old_N - rollout_N).abs()
        metrics |= _ratio_metrics("is_weight", w_N)
        metrics |= {"masked_frac": _sum64(~keep_N), "logprob_gap_mean": _sum64(gap_N),
                    "logprob_gap_max": _max64(gap_N)}

    loss = aggregate(pg_N, inp, norm, cfg.agg)
    metrics |= {"pg_loss": _sum64(pg_N), "clip_frac": _sum64(clipped_N),
                "dual_clip_frac": _sum64(dual_N), **_ratio_metrics("ratio", ratio_N),
                "approx_kl": _sum64(0.5 * (logp_N - old_N).square())}
    if inp.ref_logprobs is not None:
        kl_N = kl_estimate(logp_N, inp.ref_logprobs.detach().to(logp_N.dtype), cfg.kl_type,
                           cfg.kl_log_ratio_clamp, cfg.kl_value_clamp, cfg.kl_score_grad)
        metrics["kl"] = _sum64(kl_N)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * aggregate(kl_N, inp, norm, cfg.agg)
    if inp.entropy is not None:
        metrics["entropy"] = _sum64(inp.entropy)
        if cfg.entropy_coef > 0:
            ent_N = inp.entropy.to(logp_N.dtype)
            loss = loss - cfg.entropy_coef * aggregate(ent_N, inp, norm, cfg.agg)
    return LossOutput(loss=loss, metrics=metrics)
