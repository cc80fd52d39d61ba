"""Random transformers config kwargs per Hugging Face family (bench/family_parity.py): only values
the family's config class accepts and hf/families.py reads (no refused setting). Merged over
tests/hf/families_cases.py's BASE by its hf_config / save_random."""

from __future__ import annotations

import random

from tests.hf.families_cases import BASE


def _common(r: random.Random, head_dim_free: bool) -> dict:
    """Sizes shared by every family; without head_dim_free the head dim is hidden / heads."""
    heads = r.choice([2, 4, 8])
    hidden = r.choice([16, 32, 48]) if not head_dim_free else r.choice([16, 24, 32, 48])
    return dict(vocab_size=r.choice([64, 96, 128]), hidden_size=hidden, num_hidden_layers=r.randint(2, 4),
                num_attention_heads=heads, num_key_value_heads=r.choice([d for d in (1, 2, 4, 8) if heads % d == 0]),
                rms_norm_eps=r.choice([1e-6, 1e-5]), tie_word_embeddings=r.random() < 0.3)


def _rope(r: random.Random, yarn_share: float = 0.0, mscales: bool = False) -> dict:
    """Plain RoPE or YaRN (read for deepseek_v3 and gpt_oss only: the other families refuse it); the original context short enough that the documents (<= 32 tokens)
    reach the interpolated dims."""
    theta = r.choice([1e4, 5e5])
    if r.random() >= yarn_share:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    orig, factor = r.choice([16, 64, 256]), r.choice([2.0, 4.0, 8.0, 40.0])
    yarn = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": orig,
            "beta_fast": r.choice([32, 16, 8]), "beta_slow": r.choice([1, 2]), "truncate": r.random() < 0.5}
    if mscales:  # DeepSeek-V3: both (attention factor mscale / mscale_all_dim), one, or neither
        m, m_all = r.choice([(1.0, 0.8), (0.707, 0.707), (1.0, 1.0), (None, 1.0), (1.0, None), (None, None)])
        yarn.update({k: v for k, v in (("mscale", m), ("mscale_all_dim", m_all)) if v is not None})
    return {"rope_parameters": yarn, "max_position_embeddings": int(orig * factor)}


def _experts(r: random.Random, lo: int = 3, hi: int = 8) -> tuple[int, int]:
    e = r.randint(lo, hi)
    return e, r.randint(1, min(4, e))


def _groups(r: random.Random) -> dict:
    """Group-limited routing: n_group groups of >= 2 experts (a group scores its two best)."""
    groups = r.choice([1, 2, 4])
    e = groups * r.choice([2, 3, 4]) if groups > 1 else r.randint(3, 8)
    topk_group = r.randint(1, groups)
    return dict(n_routed_experts=e, n_group=groups, topk_group=topk_group,
                num_experts_per_tok=r.randint(1, min(4, topk_group * e // groups)),
                routed_scaling_factor=r.choice([1.0, 1.5, 2.5]), norm_topk_prob=r.random() < 0.5,
                n_shared_experts=r.choice([1, 2]), moe_intermediate_size=r.choice([8, 12, 16]),
                intermediate_size=r.choice([16, 24, 40]))


def _qwen2_moe(r):
    out = _common(r, False)
    e, k = _experts(r)
    dense = r.randint(0, min(2, out["num_hidden_layers"] - 1))
    return {**out, **_rope(r), "num_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": r.choice([8, 12, 16]),
            "shared_expert_intermediate_size": r.choice([8, 16, 24]), "intermediate_size": r.choice([16, 24, 40]),
            "norm_topk_prob": r.random() < 0.5, "qkv_bias": r.random() < 0.5, "mlp_only_layers": list(range(dense))}


def _mixtral(r):
    e, k = _experts(r)
    return {**_common(r, True), **_rope(r), "num_local_experts": e, "num_experts_per_tok": k,
            "intermediate_size": r.choice([8, 16, 24]), "head_dim": r.choice([4, 8, 16])}


def _olmoe(r):
    e, k = _experts(r)
    return {**_common(r, False), **_rope(r), "num_experts": e, "num_experts_per_tok": k,
            "intermediate_size": r.choice([8, 16, 24]), "norm_topk_prob": r.random() < 0.5,
            "eos_token_id": None}  # OLMoE's default id 50279 is outside these vocabularies


def _glm4_moe(r):
    out = {**_common(r, True), **_rope(r), **_groups(r)}
    return {**out, "first_k_dense_replace": r.randint(0, min(2, out["num_hidden_layers"] - 1)),
            "attention_bias": r.random() < 0.5, "use_qk_norm": r.random() < 0.5,
            "partial_rotary_factor": r.choice([0.5, 1.0]), "head_dim": r.choice([8, 16])}


def _deepseek_v3(r):
    # hidden / heads even: the loader takes it as model.head_dim, which must be even even though
    # MLA layers do not use it
    out = {**_common(r, False), **_rope(r, 0.75, mscales=True), **_groups(r)}
    out["num_key_value_heads"] = out["num_attention_heads"]  # MLA: every head has its own k / v
    return {**out, "first_k_dense_replace": r.randint(0, min(2, out["num_hidden_layers"] - 1)),
            "q_lora_rank": r.choice([None, 8, 12, 16]), "kv_lora_rank": r.choice([4, 8, 10, 16]),
            "qk_nope_head_dim": r.choice([2, 4, 6, 8]), "qk_rope_head_dim": r.choice([2, 4, 8]),
            "v_head_dim": r.choice([3, 5, 8]), "rope_interleave": r.random() < 0.5}


def _gpt_oss(r):
    out = {**_common(r, True), **_rope(r, 0.75)}
    e, k = _experts(r)
    kinds = [r.choice(["sliding_attention", "full_attention"]) for _ in range(out["num_hidden_layers"])]
    return {**out, "num_local_experts": e, "num_experts_per_tok": k, "intermediate_size": r.choice([8, 16]),
            "head_dim": r.choice([8, 16]), "sliding_window": r.randint(2, 6), "layer_types": kinds,
            "attention_bias": r.random() < 0.5}


DRAW = {"qwen2_moe": _qwen2_moe, "mixtral": _mixtral, "olmoe": _olmoe, "glm4_moe": _glm4_moe,
        "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss}


def draw_config(family: str, r: random.Random, avoid: list[dict] = ()) -> dict:
    """Config kwargs of `family` drawn with `r`, none equal (over BASE) to one in `avoid`."""
    while True:
        kwargs = DRAW[family](r)
        if all({**BASE, **kwargs} != {**BASE, **a} for a in avoid):
            return kwargs
