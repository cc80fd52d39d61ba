"""The model's attention with the gpt-oss features (sinks, per-layer sliding windows via
layer_types, q/k/v and output biases, YaRN RoPE) against transformers' GptOssAttention with the
same weights, in float64, over packed documents (transformers runs each document alone)."""

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
        if hf.sliding_window is not None:
            ok &= i - j < hf.sliding_window
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~ok, float("-inf"))
        cos, sin = rope(x, torch.arange(n)[None])
        out, _ = hf(x, (cos.double(), sin.double()), mask[None, None])
        outs.append(out[0])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("layer_idx", [0, 1])  # a sliding-window layer, then a full one
def test_gpt_oss_attention_matches_transformers_in_float64(layer_idx):
    hf, rope = _gpt_oss(layer_idx)
    ours = _ours(hf, layer_idx)
    assert ours.window == (WINDOW if layer_idx == 0 else None)
    doc_lens = [5, 1, 9, 2]
    batch = packed_batch(doc_lens, 64)
    x_TD = torch.randn(sum(doc_lens), 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x_ours, x_hf = x_TD.clone().requires_grad_(), x_TD.clone().requires_grad_()
    got = ours(x_ours, doc_layout(batch))
    want = _hf_packed(hf, rope, x_hf, doc_lens)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    dout = torch.randn_like(got)
    got.backward(dout)
    want.backward(dout)
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(ours.sinks.grad, hf.sinks.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(ours.wq.weight.grad, hf.q_proj.weight.grad, atol=1e-12, rtol=0)


def test_attention_feature_config_errors_name_the_key():
    with pytest.raises(ValueError, match="model.layer_types must list 2 entries"):
        tiny_config(sliding_window=4, layer_types=["sliding_attention"]).validate()
    with pytest.raises(ValueError, match="sliding_attention layers but model.sliding_window is 0"):
        tiny_config(layer_types=["sliding_attention", "full_attention"]).validate()
    with pytest.raises(ValueError, match="model.partial_rotary_factor=0.1"):
        tiny_config(partial_rotary_factor=0.1).validate()
