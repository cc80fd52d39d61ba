"""NeMo-RL's `ClippedPGLossConfig` as our `PolicyLossConfig`.

NeMo-RL configures its GRPO / PPO / GSPO / CISPO loss with one pydantic model (nemo_rl/algorithms/
loss/loss_functions.py, `ClippedPGLossConfig` and `ClippedPGLossFn`, commit 7ea279a of
2026-08-22). Every key either maps to a setting of ours that computes the same loss and the same
gradient, or is refused in one line naming it:

    disable_ppo_ratio                  kind=pg (-A * logp)
    use_cispo                          kind=cispo
    sequence_level_importance_ratios   kind=gspo (NeMo-RL needs token_level_loss=false with it)
    token_level_loss                   agg=token-mean (true) | seq-mean-token-mean (false)
    ratio_clip_min / ratio_clip_max    eps_low / eps_high
    ratio_clip_c                       dual_clip
    reference_policy_kl_penalty        kl_coef (0 when use_kl_in_reward: the KL goes to the reward)
    reference_policy_kl_type           kl_type (k1 | k2 | k3)
    kl_input_clamp_value               kl_log_ratio_clamp (null: unbounded)
    kl_output_clamp_value              kl_value_clamp (null: unbounded)
    (always)                           kl_score_grad=True: NeMo-RL multiplies the KL estimate by
                                       exp(logp - sg(logp)), which adds kl * d(logp) to its gradient
    use_importance_sampling_correction the IS weight exp(prev - generation) multiplies the policy
                                       term: tis_cap=inf, or as truncated_importance_sampling_type:
      tis                              tis_cap=ratio (ratio_min must be unset or 0)
      icepop                           icepop=[ratio_min, ratio], the kept weights multiply
      seq-mask-tis                     seq_mask_geo=[ratio_min, ratio], the kept weights multiply

Refused: force_on_policy_ratio, use_on_policy_kl_approximation, positive_example_nll_weight > 0,
dual clipping with disable_ppo_ratio, importance correction with sequence-level ratios, and any
key NeMo-RL added after that commit (a new key may change the loss).

Two differences in edge cases, both documented in docs/RL_INTEGRATION.md: log-ratios are clamped to
+-20 before exp (NeMo-RL replaces inf by 0 instead), and the sequence count of seq-mean-token-mean
counts sequences with at least one loss token (NeMo-RL counts sample_mask).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rl_hooks.adapters._common import fail
from rl_hooks.losses import PolicyLossConfig

NAME = "NeMo-RL ClippedPGLossConfig"

# ClippedPGLossConfig's keys and defaults at commit 7ea279a.
DEFAULTS: dict[str, Any] = {
    "disable_ppo_ratio": False, "token_level_loss": True,
    "sequence_level_importance_ratios": False, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2,
    "ratio_clip_c": None, "reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0, "use_kl_in_reward": False,
    "use_importance_sampling_correction": False, "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None, "truncated_importance_sampling_ratio_min": None,
    "use_on_policy_kl_approximation": False, "force_on_policy_ratio": False, "use_cispo": False,
    "positive_example_nll_weight": 0.0,
}


def nemo_rl_loss_settings(source: Any) -> dict[str, Any]:
    """The ClippedPGLossConfig keys of `source`, defaults filled in: a mapping (the `loss_fn`
    section of a NeMo-RL YAML), the pydantic ClippedPGLossConfig, or a ClippedPGLossFn (whose
    attributes hold the same settings; its loss_type stands for token_level_loss)."""
    if hasattr(source, "model_dump"):
        source = source.model_dump()
    if not isinstance(source, Mapping):
        if not hasattr(source, "ratio_clip_min"):
            fail(NAME, "loss_fn", f"a {type(source).__name__} is neither a ClippedPGLossFn nor "
                                  "its config; pass the loss_fn NeMo-RL built or its config mapping")
        return _from_loss_fn(source)
    unknown = sorted(set(source) - set(DEFAULTS))
    if unknown:
        fail(NAME, unknown[0], "is not a key this mapping knows (NeMo-RL 7ea279a); it may change "
                               "the loss, so remove it or extend rl_hooks/plugins/nemo_rl/loss.py")
    return {**DEFAULTS, **source}


def _from_loss_fn(fn: Any) -> dict[str, Any]:
    out = {key: getattr(fn, key, default) for key, default in DEFAULTS.items()}
    loss_type = getattr(fn, "loss_type", None)
    if loss_type is not None:
        out["token_level_loss"] = "TOKEN" in str(loss_type).upper()
    return out


def loss_config_from_nemo_rl(source: Any) -> PolicyLossConfig:
    """Our PolicyLossConfig computing NeMo-RL's ClippedPG loss (see the module docstring), or
    AdapterError naming the first key that has no exact counterpart."""
    s = nemo_rl_loss_settings(source)
    _refuse_unsupported(s)
    kind = ("cispo" if s["use_cispo"] else "pg" if s["disable_ppo_ratio"]
            else "gspo" if s["sequence_level_importance_ratios"] else "ppo")
    kl_coef = 0.0 if s["use_kl_in_reward"] else float(s["reference_policy_kl_penalty"])
    cfg = PolicyLossConfig(
        kind=kind, agg="token-mean" if s["token_level_loss"] else "seq-mean-token-mean",
        eps_low=float(s["ratio_clip_min"]), eps_high=float(s["ratio_clip_max"]),
        dual_clip=s["ratio_clip_c"], kl_coef=kl_coef, kl_type=s["reference_policy_kl_type"],
        kl_log_ratio_clamp=_bound(s["kl_input_clamp_value"]),
        kl_value_clamp=_bound(s["kl_output_clamp_value"]), kl_score_grad=True,
        **_corrections(s))
    try:
        cfg.validate()
    except ValueError as e:
        fail(NAME, "loss_fn", f"maps to an invalid PolicyLossConfig: {e}")
    return cfg


def _bound(value: float | None) -> float:
    return math.inf if value is None else float(value)


def _refuse_unsupported(s: dict[str, Any]) -> None:
    refusals = {
        "force_on_policy_ratio": (s["force_on_policy_ratio"], "set it false: the worker takes "
                                  "prev_logprobs from the batch (pass the policy's own for one "
                                  "update per rollout)"),
        "use_on_policy_kl_approximation": (s["use_on_policy_kl_approximation"], "has no "
                                           "counterpart here; set it false"),
        "positive_example_nll_weight": (s["positive_example_nll_weight"] > 0, "the VAPO NLL term "
                                        "has no counterpart here; set it to 0"),
        "ratio_clip_c": (s["ratio_clip_c"] is not None and (s["disable_ppo_ratio"] or s["use_cispo"]),
                         "dual clipping applies to ratio losses only; set it null with "
                         "disable_ppo_ratio or use_cispo"),
        "sequence_level_importance_ratios": (
            s["sequence_level_importance_ratios"] and (s["token_level_loss"]
                                                       or s["use_importance_sampling_correction"]),
            "GSPO needs token_level_loss=false and no importance correction (NeMo-RL's sequence "
            "IS weight has no counterpart)"),
        "reference_policy_kl_type": (s["reference_policy_kl_type"] not in ("k1", "k2", "k3"),
                                     "choose k1, k2 or k3"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            fail(NAME, key, f"= {s[key]!r}: {why}")


def _corrections(s: dict[str, Any]) -> dict[str, Any]:
    kind = s["truncated_importance_sampling_type"]
    if not s["use_importance_sampling_correction"]:
        if kind is not None:
            fail(NAME, "truncated_importance_sampling_type", f"= {kind!r} needs "
                 "use_importance_sampling_correction: true (as NeMo-RL requires)")
        return {}
    hi, lo = s["truncated_importance_sampling_ratio"], s["truncated_importance_sampling_ratio_min"]
    if kind is None:
        return {"tis_cap": math.inf}
    if hi is None or not hi > 0:
        fail(NAME, "truncated_importance_sampling_ratio", f"= {hi!r}: must be > 0 with "
                                                          f"truncated_importance_sampling_type={kind!r}")
    if kind == "tis":
        if lo:
            fail(NAME, "truncated_importance_sampling_ratio_min", f"= {lo!r}: a lower bound on the "
                 "TIS weight has no counterpart here; leave it unset with type tis")
        return {"tis_cap": float(hi)}
    if kind in ("icepop", "seq-mask-tis"):
        if lo is None:
            fail(NAME, "truncated_importance_sampling_ratio_min", f"must be set with type {kind!r}")
        key = "icepop" if kind == "icepop" else "seq_mask_geo"
        return {key: (float(lo), float(hi)), "tis_cap": math.inf}
    fail(NAME, "truncated_importance_sampling_type", f"= {kind!r}: choose tis, icepop or seq-mask-tis")
