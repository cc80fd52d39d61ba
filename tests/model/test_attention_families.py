"""The model's attention with the gpt-oss features (sinks, per-layer sliding windows via
layer_types, q/k/v and output biases, YaRN RoPE) against transformers' GptOssAttention, and MLA
against DeepseekV3Attention, with the same weights, in float64, over packed documents
(transformers runs each document alone)."""

import pytest
import torch

from longctx_moe.model.attention import Attention, doc_layout
from tests.model.helpers import packed_batch, tiny_config

transformers = pytest.importorskip("transformers")

WINDOW = 3
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False, "rope_theta": 150000.0}


def _gpt_oss(layer_idx):
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    cfg = m.GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_hidden_layers=2, sliding_window=WINDOW, attention_bias=True,
                         layer_types=["sliding_attention", "full_attention"],
                         rope_parameters=dict(YARN), max_position_embeddings=131072)
    cfg._attn_implementation = "eager"
    torch.manual_seed(layer_idx)
    hf = m.GptOssAttention(cfg, layer_idx).double()
    with torch.no_grad():
        hf.sinks.normal_()
    return hf, m.GptOssRotaryEmbedding(cfg)


def _ours(hf, layer_idx):
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"}
    cfg = tiny_config(qk_norm=False, qkv_bias=True, attention_out_bias=True, attention_sinks=True,
                      sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                      rope_theta=150000.0, rope_scaling=scaling, max_position_embeddings=131072)
    cfg.validate()
    ours = Attention(cfg, layer_idx).double()
    pairs = [(ours.wq, hf.q_proj), (ours.wk, hf.k_proj), (ours.wv, hf.v_proj), (ours.wo, hf.o_proj)]
    with torch.no_grad():
        for a, b in pairs:
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)
        ours.sinks.copy_(hf.sinks)
    return ours


def _hf_packed(hf, rope, x_TD, doc_lens):
    """Each document alone through GptOssAttention (causal, windowed on sliding layers)."""
    outs, start = [], 0
    for n in doc_lens:
        x = x_TD[start:start + n][None]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        ok = j <= i
        if getattr(hf, "sliding_window", None) is not None:
            ok &= i - j < hf.sliding_window
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~ok, float("-inf"))
        cos, sin = rope(x, torch.arange(n)[None])
        out, _ = hf(x, (cos.double(), sin.double()), mask[None, None])
        outs.append(out[0])
        start += n
    return torch.cat(outs)


def _assert_same(ours, hf, rope, doc_lens, seed, params):
    """Output, input gradient and the gradients of `params` (ours, transformers') over a packed
    row of `doc_lens`, to 1e-12 (float64 on both sides; only the summation order differs)."""
    x_TD = torch.randn(sum(doc_lens), 32, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))
    x_ours, x_hf = x_TD.clone().requires_grad_(), x_TD.clone().requires_grad_()
    got = ours(x_ours, doc_layout(packed_batch(doc_lens, 64)))
    want = _hf_packed(hf, rope, x_hf, doc_lens)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    dout = torch.randn_like(got)
    got.backward(dout)
    want.backward(dout)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-12, rtol=0)
    for mine, theirs in params:
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layer_idx", [0, 1])  # a sliding-window layer, then a full one
def test_gpt_oss_attention_matches_transformers_in_float64(layer_idx):
    hf, rope = _gpt_oss(layer_idx)
    ours = _ours(hf, layer_idx)
    assert ours.window == (WINDOW if layer_idx == 0 else None)
    _assert_same(ours, hf, rope, [5, 1, 9, 2], 3, [(ours.sinks, hf.sinks),
                                                    (ours.wq.weight, hf.q_proj.weight)])


def test_attention_feature_config_errors_name_the_key():
    with pytest.raises(ValueError, match="model.layer_types must list 2 entries"):
        tiny_config(sliding_window=4, layer_types=["sliding_attention"]).validate()
    with pytest.raises(ValueError, match="sliding_attention layers but model.sliding_window is 0"):
        tiny_config(layer_types=["sliding_attention", "full_attention"]).validate()
    with pytest.raises(ValueError, match="model.partial_rotary_factor=0.1"):
        tiny_config(partial_rotary_factor=0.1).validate()


DSV3_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
             "rope_theta": 10000.0}


def _deepseek_v3(q_lora_rank, interleave):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = m.DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                             q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=6,
                             qk_rope_head_dim=4, v_head_dim=5, rope_parameters=dict(DSV3_YARN),
                             max_position_embeddings=163840, rope_interleave=interleave,
                             rms_norm_eps=1e-6)
    # sdpa keeps float64 throughout; transformers' eager path here takes its softmax in float32.
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(7)
    hf = m.DeepseekV3Attention(cfg, 0).double()
    for name in ("kv_a_layernorm", "q_a_layernorm"):
        if hasattr(hf, name):
            setattr(hf, name, _Float64RMSNorm(getattr(hf, name)))
    return hf, m.DeepseekV3RotaryEmbedding(cfg)


class _Float64RMSNorm(torch.nn.Module):
    """transformers' DeepseekV3RMSNorm formula without its float32 cast (which would limit a
    float64 comparison to ~1e-7); non-trivial weights."""

    def __init__(self, norm):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty_like(norm.weight).uniform_(0.5, 1.5))
        self.eps = norm.variance_epsilon

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


@pytest.mark.parametrize("q_lora_rank,interleave", [(10, True), (None, False)])
def test_mla_matches_deepseek_v3_attention_in_float64(q_lora_rank, interleave):
    """MLA (low-rank q or not, interleaved rope dims or not, YaRN with mscale in the softmax
    scale, v head dim 5 against q/k 10) against transformers' DeepseekV3Attention."""
    from longctx_moe.model.mla import MLAttention

    hf, rope = _deepseek_v3(q_lora_rank, interleave)
    scaling = {k: v for k, v in DSV3_YARN.items() if k != "rope_theta"}
    cfg = tiny_config(attention_type="mla", q_lora_rank=q_lora_rank or 0, kv_lora_rank=12,
                      qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, qk_norm=False,
                      rope_scaling=scaling, max_position_embeddings=163840,
                      rope_interleave=interleave)
    cfg.validate()
    ours = MLAttention(cfg).double()
    ours.load_state_dict(hf.state_dict())  # the same weight names as transformers
    _assert_same(ours, hf, rope, [4, 1, 7], 5, [(ours.kv_b_proj.weight, hf.kv_b_proj.weight)])
