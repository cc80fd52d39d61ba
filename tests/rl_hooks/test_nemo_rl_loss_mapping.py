"""NeMo-RL's ClippedPGLossConfig mapped to our loss: each key gives the loss and the gradient that
NeMo-RL's formula gives (float64), and every key without a counterpart is refused in one line.

`nemo_clipped_pg` below is NeMo-RL's ClippedPGLossFn written out from its definition (commit
7ea279a) on the [B, S'] layout its loss reads (the [:, 1:] slices). NeMo-RL adds 1e-8 to every
normaliser (a guard against empty masks, relative 1e-8 / count); the reference takes that guard
as a parameter, and the comparison sets it to 0 so that the maths is compared to float64 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_hooks.adapters import AdapterError
from rl_hooks.losses import LossInputs, Normalizers, make_loss
from rl_hooks.plugins.nemo_rl.loss import DEFAULTS, loss_config_from_nemo_rl

B, S = 5, 9  # rows, loss-layout width (NeMo-RL's sequence length - 1)


GUARD = 0.0  # NeMo-RL's 1e-8 added to normalisers (see the module docstring)


def _row_mean(x, m):
    return (x * m).sum(-1) / (m.sum(-1) + GUARD)


def _kl(s, curr, ref):
    logr = ref - curr
    w = torch.exp(curr - curr.detach())
    if s["kl_input_clamp_value"] is not None:
        c = s["kl_input_clamp_value"]
        bounded = logr.clamp(-c, c)
        w = torch.where(logr == bounded, w, w.detach())
        logr = bounded
    kl = {"k1": -logr, "k2": logr.square() / 2,
          "k3": torch.exp(logr) - 1 - logr}[s["reference_policy_kl_type"]] * w
    if s["kl_output_clamp_value"] is not None:
        kl = kl.clamp(-s["kl_output_clamp_value"], s["kl_output_clamp_value"])
    return kl


def _is_weights(s, prev, gen, tmask):
    w = torch.exp(prev - gen)
    kind, hi, lo = (s["truncated_importance_sampling_type"], s["truncated_importance_sampling_ratio"],
                    s["truncated_importance_sampling_ratio_min"])
    if kind == "tis":
        w = w.clamp(min=lo or 0.0, max=hi)
    elif kind == "icepop":
        w = torch.where((w >= lo) & (w <= hi), w, torch.zeros_like(w))
    elif kind == "seq-mask-tis":
        geo = torch.exp(_row_mean(prev - gen, tmask))
        w = w * ((geo >= lo) & (geo <= hi)).to(w.dtype)[:, None]
    return w


def nemo_clipped_pg(s, curr, prev, gen, ref, adv, tmask, smask):
    """NeMo-RL's ClippedPG loss of one micro-batch that is the whole global batch."""
    mask = tmask * smask[:, None]
    toks, seqs = mask.sum(), smask.sum()

    def reduce(x):
        if s["token_level_loss"]:
            return (x * mask).sum() / (toks + GUARD)
        return (_row_mean(x, tmask) * smask).sum() / (seqs + GUARD)

    penalty = 0.0 if s["use_kl_in_reward"] else s["reference_policy_kl_penalty"]
    kl = reduce(penalty * _kl(s, curr, ref)) if penalty else 0.0
    if s["disable_ppo_ratio"]:
        ratios = clamped = curr
    else:
        log_r = curr - prev
        if s["sequence_level_importance_ratios"]:
            ratios = torch.exp(_row_mean(log_r, tmask))[:, None].expand_as(curr)
        else:
            ratios = torch.exp(log_r)
        clamped = ratios.clamp(1 - s["ratio_clip_min"], 1 + s["ratio_clip_max"])
    if s["use_cispo"]:
        clip_loss = -adv * clamped.detach() * curr
    else:
        clip_loss = torch.max(-adv * ratios, -adv * clamped)
    if s["ratio_clip_c"] is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * s["ratio_clip_c"]), clip_loss)
    weights = (_is_weights(s, prev, gen, tmask) if s["use_importance_sampling_correction"]
               else torch.ones_like(prev))
    return reduce(weights * clip_loss) + kl


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    prev = -torch.rand(B, S, generator=g, **f64) * 3
    curr = (prev + 0.4 * torch.randn(B, S, generator=g, **f64)).clamp(max=-1e-3)
    gen = prev + 0.3 * torch.randn(B, S, generator=g, **f64)
    ref = prev + 0.8 * torch.randn(B, S, generator=g, **f64)
    adv = torch.randn(B, 1, generator=g, **f64).expand(B, S).clone()
    tmask = (torch.rand(B, S, generator=g) < 0.7).to(torch.float64)
    tmask[:, 0] = 1.0  # every row keeps a loss token
    smask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], **f64)
    return curr.requires_grad_(), prev, gen, ref, adv, tmask, smask


def _ours(cfg, curr, prev, gen, ref, adv, tmask, smask):
    mask = (tmask * smask[:, None]).bool()
    rows = mask.any(1).nonzero().flatten()
    seq_of_row = torch.full((B,), -1, dtype=torch.int64)
    seq_of_row[rows] = torch.arange(len(rows))
    seq_index = seq_of_row[:, None].expand(B, S)[mask]
    inp = LossInputs(curr[mask], prev[mask], adv[mask], seq_index, len(rows),
                     ref_logprobs=ref[mask], rollout_logprobs=gen[mask])
    return make_loss(cfg)(inp, Normalizers(int(mask.sum()), len(rows))).loss


CASES = {
    "defaults (ppo, token-level, k3 kl with both clamps)": {},
    "asymmetric clip": dict(ratio_clip_min=0.1, ratio_clip_max=0.3),
    "dual clip": dict(ratio_clip_c=1.5, ratio_clip_min=0.05, ratio_clip_max=0.05),
    "sequence-level loss": dict(token_level_loss=False),
    "gspo": dict(sequence_level_importance_ratios=True, token_level_loss=False,
                 ratio_clip_min=0.05, ratio_clip_max=0.08),
    "reinforce": dict(disable_ppo_ratio=True),
    "cispo": dict(use_cispo=True, ratio_clip_min=0.1, ratio_clip_max=0.1),
    "k1 kl, tight clamps": dict(reference_policy_kl_type="k1", reference_policy_kl_penalty=0.5,
                                kl_input_clamp_value=0.6, kl_output_clamp_value=0.4),
    "k2 kl, unclamped": dict(reference_policy_kl_type="k2", reference_policy_kl_penalty=0.3,
                             kl_input_clamp_value=None, kl_output_clamp_value=None),
    "k3 kl, output clamp active": dict(reference_policy_kl_penalty=0.2, kl_output_clamp_value=0.05),
    "kl in the reward": dict(use_kl_in_reward=True, reference_policy_kl_penalty=0.5),
    "no kl": dict(reference_policy_kl_penalty=0.0),
    "importance correction": dict(use_importance_sampling_correction=True),
    "tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=1.2),
    "icepop": dict(use_importance_sampling_correction=True,
                   truncated_importance_sampling_type="icepop",
                   truncated_importance_sampling_ratio=1.3,
                   truncated_importance_sampling_ratio_min=0.8),
    "seq-mask-tis": dict(use_importance_sampling_correction=True,
                         truncated_importance_sampling_type="seq-mask-tis",
                         truncated_importance_sampling_ratio=1.1,
                         truncated_importance_sampling_ratio_min=0.95),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_each_setting_gives_nemo_rls_loss_and_gradient_float64(name, seed):
    settings = {**DEFAULTS, **CASES[name]}
    curr, *rest = _batch(seed)
    theirs = nemo_clipped_pg(settings, curr, *rest)
    ours = _ours(loss_config_from_nemo_rl(CASES[name]), curr, *rest)
    (g_theirs,) = torch.autograd.grad(theirs, curr)
    (g_ours,) = torch.autograd.grad(ours, curr)
    # float64: the two differ only in the order of a few sums and products.
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-12, atol=1e-14)


def test_the_kl_score_term_changes_the_gradient_not_the_value():
    """Without kl_score_grad our k3 gradient differs from NeMo-RL's: the case above is not blind."""
    curr, *rest = _batch(3)
    cfg = loss_config_from_nemo_rl({"reference_policy_kl_penalty": 0.5})
    plain = loss_config_from_nemo_rl({"reference_policy_kl_penalty": 0.5})
    plain.kl_score_grad = False
    a, b = _ours(cfg, curr, *rest), _ours(plain, curr, *rest)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    (ga,) = torch.autograd.grad(a, curr)
    (gb,) = torch.autograd.grad(b, curr)
    assert (ga - gb).abs().max() > 1e-3


def test_a_loss_fn_object_maps_like_its_config():
    """NeMo-RL hands the worker a ClippedPGLossFn; its attributes carry the same settings."""

    class LossType:  # NeMo-RL's enum prints as LossType.SEQUENCE_LEVEL
        def __str__(self):
            return "LossType.SEQUENCE_LEVEL"

    class ClippedPGLossFn:
        pass

    fn = ClippedPGLossFn()
    for key, value in {**DEFAULTS, "ratio_clip_max": 0.28, "use_cispo": True}.items():
        setattr(fn, key, value)
    fn.loss_type = LossType()
    expected = loss_config_from_nemo_rl({"ratio_clip_max": 0.28, "use_cispo": True,
                                         "token_level_loss": False})
    assert loss_config_from_nemo_rl(fn) == expected


@pytest.mark.parametrize("settings, key", [
    (dict(force_on_policy_ratio=True), "force_on_policy_ratio"),
    (dict(use_on_policy_kl_approximation=True), "use_on_policy_kl_approximation"),
    (dict(positive_example_nll_weight=0.1), "positive_example_nll_weight"),
    (dict(disable_ppo_ratio=True, ratio_clip_c=3.0), "ratio_clip_c"),
    (dict(sequence_level_importance_ratios=True), "sequence_level_importance_ratios"),
    (dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
     "truncated_importance_sampling_type"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
          truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=0.5),
     "truncated_importance_sampling_ratio_min"),
    (dict(reference_policy_kl_type="k4"), "reference_policy_kl_type"),
    (dict(a_key_from_a_newer_release=1), "a_key_from_a_newer_release"),
])
def test_settings_without_a_counterpart_are_refused_in_one_line(settings, key):
    with pytest.raises(AdapterError) as e:
        loss_config_from_nemo_rl(settings)
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)


def test_unbounded_kl_clamps_map_to_inf():
    cfg = loss_config_from_nemo_rl({"kl_input_clamp_value": None, "kl_output_clamp_value": None})
    assert cfg.kl_log_ratio_clamp == math.inf and cfg.kl_value_clamp == math.inf
