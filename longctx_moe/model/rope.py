"""RoPE variants of pretrained families, in transformers' conventions:

- partial rotary (GLM-4.5, `partial_rotary_factor`): only the first R = int(head_dim * factor)
  dims of each head rotate (rotate-half inside those R), the rest pass through;
- YaRN (DeepSeek-V3, `rope_scaling` {"type": "yarn", factor, original_max_position_embeddings,
  beta_fast, beta_slow, mscale, mscale_all_dim}): inverse frequencies blended between
  interpolated and extrapolated by a linear ramp over the dims, and cos / sin multiplied by the
  attention factor get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim).
  DeepSeek-V3 also multiplies its softmax scale by get_mscale(factor, mscale_all_dim)^2
  (`yarn_softmax_scale_factor`).

    spec = RopeSpec.from_config(rotary_dim, theta, rope_scaling, max_position_embeddings)
    cos_TR, sin_TR = rope_tables(position_ids_T, spec)      # float32, R = spec.rotary_dim
    x_THD = apply_partial_rope(x_THD, cos_TR, sin_TR)       # rotates x[..., :R]

Shape legend: T tokens, H heads, D head dim, R rotary dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longctx_moe.model.layers import apply_rope

ROPE_TYPES = ("default", "yarn")


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    """What the cos / sin tables depend on (hashable: the per-micro-batch cache key)."""

    rotary_dim: int
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    @staticmethod
    def from_config(rotary_dim: int, theta: float, scaling: dict | None,
                    max_position_embeddings: int = 0) -> RopeSpec:
        """From a transformers-style rope_scaling dict (None: plain RoPE)."""
        scaling = dict(scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"model.rope_scaling type {kind!r} is not supported; choose one of "
                             f"{ROPE_TYPES} (or remove model.rope_scaling)")
        if kind == "default":
            return RopeSpec(rotary_dim, theta)
        orig = int(scaling.get("original_max_position_embeddings") or 0)
        if orig < 1:
            raise ValueError("model.rope_scaling of type yarn needs original_max_position_embeddings")
        factor = scaling.get("factor") or max_position_embeddings / orig
        att = scaling.get("attention_factor")
        if att is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            att = get_mscale(factor, m) / get_mscale(factor, m_all) if m and m_all else get_mscale(factor)
        return RopeSpec(rotary_dim, theta, "yarn", float(factor), orig,
                        float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1),
                        float(att), bool(scaling.get("truncate", True)))


def yarn_softmax_scale_factor(scaling: dict | None) -> float:
    """DeepSeek-V3's extra softmax-scale multiplier under YaRN: get_mscale(factor,
    mscale_all_dim)^2 (1 without YaRN or without mscale_all_dim)."""
    scaling = dict(scaling or {})
    if scaling.get("rope_type", scaling.get("type")) != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return get_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


def inv_freq(spec: RopeSpec, device=None) -> torch.Tensor:
    """float32 [R/2] inverse frequencies (transformers' default / yarn formulas)."""
    r = spec.rotary_dim
    pos_freqs = spec.theta ** (torch.arange(0, r, 2, device=device, dtype=torch.float32) / r)
    if spec.rope_type == "default":
        return 1.0 / pos_freqs
    low, high = _correction_range(spec)
    ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float32, device=device) - low)
                       / (high - low if high != low else 0.001), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (spec.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _correction_range(spec: RopeSpec) -> tuple[float, float]:
    """Dims whose wavelengths fit between beta_fast and beta_slow rotations of the original
    context: the ramp between extrapolated (fast) and interpolated (slow) frequencies."""
    def dim_of(rotations):
        return (spec.rotary_dim * math.log(spec.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(spec.theta)))

    low, high = dim_of(spec.beta_fast), dim_of(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, spec.rotary_dim - 1)


def rope_tables(position_ids_T: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) [T, R], halves repeated (rotate-half layout), times the attention
    factor as transformers applies it."""
    freqs_TR2 = position_ids_T.float()[:, None] * inv_freq(spec, position_ids_T.device)[None, :]
    emb_TR = torch.cat((freqs_TR2, freqs_TR2), dim=-1)
    return emb_TR.cos() * spec.attention_factor, emb_TR.sin() * spec.attention_factor


def apply_partial_rope(x_THD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R dims of each head; the other D - R pass through."""
    r = cos_TR.shape[-1]
    if r == x_THD.shape[-1]:
        return apply_rope(x_THD, cos_TR, sin_TR)
    return torch.cat((apply_rope(x_THD[..., :r], cos_TR, sin_TR), x_THD[..., r:]), dim=-1)
