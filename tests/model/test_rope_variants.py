"""RoPE variants against transformers' rotary embeddings in float64: partial rotary (GLM-4.5's
partial_rotary_factor) and YaRN with DeepSeek-V3's mscale / mscale_all_dim."""

import math

import pytest
import torch

from longctx_moe.model.rope import (
    RopeSpec,
    apply_partial_rope,
    rope_tables,
    yarn_softmax_scale_factor,
)

transformers = pytest.importorskip("transformers")

POS = torch.tensor([0, 1, 2, 3, 0, 1, 70000, 5, 163839])  # restarts per document; long positions


def _hf_rotate(module, q, k, apply_fn):
    """transformers' cos / sin for POS and its apply function, in float64."""
    cos, sin = module(q, POS[None])
    return apply_fn(q, k, cos.double(), sin.double())


def _ours(q, k, spec):
    cos, sin = rope_tables(POS, spec)
    # [1, H, T, D] -> [T, H, D] and back, as the model holds q / k
    rot = lambda x: apply_partial_rope(x[0].transpose(0, 1), cos.double(), sin.double()).transpose(0, 1)[None]
    return rot(q), rot(k)


def test_partial_rotary_matches_glm4_moe():
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    cfg = m.Glm4MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                          partial_rotary_factor=0.5, rope_theta=10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, POS.numel(), 32, generator=g, dtype=torch.float64) for _ in range(2))
    want = _hf_rotate(m.Glm4MoeRotaryEmbedding(cfg), q, k, m.apply_rotary_pos_emb)
    got = _ours(q, k, RopeSpec.from_config(16, 10000.0, None))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)  # same float32 angles, float64 maths
    assert torch.equal(got[0][..., 16:], q[..., 16:])  # the unrotated half passes through


def test_yarn_matches_deepseek_v3_with_mscale():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    scaling = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
    cfg = m.DeepseekV3Config(hidden_size=64, num_attention_heads=2, qk_rope_head_dim=16,
                             rope_scaling=dict(scaling), max_position_embeddings=163840,
                             rope_theta=10000.0, rope_interleave=False)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, POS.numel(), 16, generator=g, dtype=torch.float64) for _ in range(2))
    hf_rope = m.DeepseekV3RotaryEmbedding(cfg)
    want = _hf_rotate(hf_rope, q, k, m.apply_rotary_pos_emb)
    spec = RopeSpec.from_config(16, 10000.0, scaling, 163840)
    assert spec.attention_factor == pytest.approx(hf_rope.attention_scaling, abs=1e-15)
    assert spec.attention_factor != 1.0  # mscale != mscale_all_dim: the tables are scaled
    for a, b in zip(_ours(q, k, spec), want, strict=True):
        # float32 angles of positions up to 163839 agree bit for bit; the rest is float64
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert yarn_softmax_scale_factor(scaling) == pytest.approx(mscale ** 2)
    assert yarn_softmax_scale_factor(None) == 1.0


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        RopeSpec.from_config(16, 1e4, {"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        RopeSpec.from_config(16, 1e4, {"type": "yarn", "factor": 2.0})
