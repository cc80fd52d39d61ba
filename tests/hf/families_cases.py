"""Small random checkpoints of every supported family, made with transformers' own config
classes and saved with save_pretrained (no downloads), and the reference log-probs."""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import torch

BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2, rms_norm_eps=1e-6)

# Two configurations per family: the second varies what the family lets vary (renormalisation,
# GQA, tied embeddings, dense first layers, q/k norm...).
CASES = {
    "qwen2_moe": [dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, intermediate_size=40),
                  dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8, norm_topk_prob=True,
                       shared_expert_intermediate_size=16, intermediate_size=24, mlp_only_layers=[0],
                       num_hidden_layers=3, qkv_bias=True, tie_word_embeddings=True)],
    "mixtral": [dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
                dict(num_local_experts=6, num_experts_per_tok=1, intermediate_size=24,
                     num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)],
    "olmoe": [dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16),
              dict(num_experts=8, num_experts_per_tok=3, intermediate_size=8, norm_topk_prob=True,
                   num_key_value_heads=4)],
    # GLM-4.5's partial RoPE (half the head dims rotate), then full RoPE.
    "glm4_moe": [dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=40,
                      first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1,
                      routed_scaling_factor=2.5, partial_rotary_factor=0.5, head_dim=8),
                 dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=8, intermediate_size=24,
                      first_k_dense_replace=0, n_group=4, topk_group=2, n_shared_experts=2, norm_topk_prob=False,
                      attention_bias=True, use_qk_norm=True, partial_rotary_factor=1.0, head_dim=8)],
    # MLA: a q bottleneck or none, interleaved rope dims or not, YaRN with mscale, an rms_norm_eps
    # other than the latent norms' 1e-6.
    "deepseek_v3": [dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         intermediate_size=40, first_k_dense_replace=1, n_group=2, topk_group=1,
                         n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=12,
                         kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                         num_key_value_heads=4, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 256, "beta_fast": 32,
                                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}),
                    dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=8,
                         intermediate_size=24, first_k_dense_replace=0, n_group=4, topk_group=2,
                         n_shared_experts=2, norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=8,
                         qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8,
                         num_key_value_heads=4, rope_interleave=False),
                    # rms_norm_eps 1e-5: the latent norms still use 1e-6 (model/mla.py).
                    dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=12,
                         intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1,
                         n_shared_experts=1, routed_scaling_factor=1.5, q_lora_rank=8, kv_lora_rank=4,
                         qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=8, num_attention_heads=8,
                         num_key_value_heads=8, hidden_size=16, rms_norm_eps=1e-5)],
    # gpt-oss: sinks, biases everywhere, clamped SwiGLU; alternating sliding / full layers with
    # its default YaRN (truncate false), then a window on two of three layers, no attention
    # biases, tied embeddings and a YaRN with truncation.
    "gpt_oss": [dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, head_dim=8,
                     sliding_window=4),
                dict(num_local_experts=6, num_experts_per_tok=3, intermediate_size=8, head_dim=16,
                     num_key_value_heads=4, sliding_window=3, num_hidden_layers=3, attention_bias=False,
                     layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                     tie_word_embeddings=True, max_position_embeddings=1024,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 256, "truncate": True})],
}
CONFIG_CLASS = {"qwen2_moe": "Qwen2MoeConfig", "mixtral": "MixtralConfig", "olmoe": "OlmoeConfig",
                "glm4_moe": "Glm4MoeConfig", "deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig"}
# gpt-oss's experts scaled up so that its SwiGLU clamp (at 7) acts on a good share of the rows.
GATE_UP_SCALE = {"gpt_oss": 6.0}
IDS = [f"{fam}-{i}" for fam, cases in CASES.items() for i in range(len(cases))]
PARAMS = [(fam, kw) for fam, cases in CASES.items() for kw in cases]


def hf_config(family: str, kwargs: dict):
    import transformers

    cfg = getattr(transformers, CONFIG_CLASS[family])(**{**BASE, **kwargs})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the grouped_mm experts reject float64
    return cfg


def save_random(family: str, kwargs: dict, path, seed: int = 0):
    """A random checkpoint of `family` in `path`; returns the transformers model (float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, kwargs)).eval()
    with torch.no_grad():  # HF initialises the GLM correction bias at 0; a real one is not
        for name, p in model.named_parameters():
            if name.endswith(("e_score_correction_bias", ".bias", "_proj_bias", ".sinks")):
                p.normal_(0.0, 0.5 if name.endswith(("_proj_bias", ".sinks")) else 0.2)
            if name.endswith("experts.gate_up_proj"):
                p.mul_(GATE_UP_SCALE.get(family, 1.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model


def hf_token_logprobs(model, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """log p(doc[t+1] | doc[:t+1]) of each document on its own (transformers' forward)."""
    out = []
    with torch.no_grad():
        for tokens in docs:
            logits = model(input_ids=tokens[None]).logits[0].to(torch.float64)
            out.append(logits[:-1].log_softmax(-1).gather(1, tokens[1:, None])[:, 0])
    return out


def packed_logprobs(model, batch) -> list[torch.Tensor]:
    """Our per-token log-probs of a packed batch, split per document (float64)."""
    from longctx_moe.model.transformer import LogProbHead

    with torch.no_grad():
        logp_T = model(batch, head=LogProbHead()).logprobs_T.to(torch.float64)
    cu = batch.cu_seqlens.tolist()
    return [logp_T[s:e - 1] for s, e in zip(cu[:-1], cu[1:], strict=True)]


def batch_docs(batch) -> list[torch.Tensor]:
    cu = batch.cu_seqlens.tolist()
    return [batch.tokens[s:e] for s, e in zip(cu[:-1], cu[1:], strict=True)]


class _Float64Torch(types.ModuleType):
    """`torch` as a transformers modeling module sees it under hf_float64: float32 is float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _keep_float64(self):
    return self if self.dtype == torch.float64 else _TENSOR_FLOAT(self)


_TENSOR_FLOAT = torch.Tensor.float


@contextmanager
def hf_float64(model):
    """transformers' forward of `model` (already .double()) in float64 throughout: its RMSNorms,
    attention softmax and routers cast to float32 by name (torch.float32 / torch.float in the
    modeling module, Tensor.float() in Mixtral's router), which would hold a float64 comparison
    at float32 rounding. The RoPE tables stay float32 angles, as ours (rope_tables) are."""
    module = sys.modules[type(model).__module__]
    real_torch = module.torch
    routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
    hooks = [h for m in routers for h in (
        m.register_forward_pre_hook(lambda *_: setattr(torch.Tensor, "float", _keep_float64)),
        m.register_forward_hook(lambda *_: setattr(torch.Tensor, "float", _TENSOR_FLOAT)))]
    module.torch = _Float64Torch("torch")
    try:
        yield model
    finally:
        module.torch = real_torch
        torch.Tensor.float = _TENSOR_FLOAT
        for h in hooks:
            h.remove()
