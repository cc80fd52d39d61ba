"""Hugging Face interop for Qwen3-MoE (transformers >= 5, imported lazily).

Our layout vs. HF's `Qwen3MoeForCausalLM` (transformers 5 fuses the experts):
    experts.w_gate_up [E, D, 2, F] <-> mlp.experts.gate_up_proj [E, 2F, D]  (gate rows first, then up)
    experts.w_down    [E, F, D]   <->  mlp.experts.down_proj    [E, D, F]
    router.weight     [E, D]      <->  mlp.gate.weight          [E, D]
Dense first layers map to HF's `mlp_only_layers` with `intermediate_size = dense_hidden_size`.
Features Qwen3-MoE lacks (sigmoid router, shared expert, expert bias, no q/k-norm) are refused.
"""

from __future__ import annotations

import torch

from longctx_moe.model.config import ModelConfig

_ATTN = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
         "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm",
         "attn.k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
         "ffn_norm": "post_attention_layernorm"}
_DENSE = {"ffn.w_gate": "mlp.gate_proj", "ffn.w_up": "mlp.up_proj", "ffn.w_down": "mlp.down_proj"}
_SHARED_MOE_NAMES = {"ffn.router.weight": "mlp.gate.weight"}
_EXPERTS = {"ffn.experts.w_gate_up": "mlp.experts.gate_up_proj", "ffn.experts.w_down": "mlp.experts.down_proj"}


def _check_supported(cfg: ModelConfig) -> None:
    refusals = [(cfg.router_score != "softmax", "model.router_score must be 'softmax'"),
                (cfg.shared_expert_hidden_size > 0, "model.shared_expert_hidden_size must be 0"),
                (cfg.expert_bias, "model.expert_bias must be false"),
                (not cfg.qk_norm, "model.qk_norm must be true")]
    for bad, fix in refusals:
        if bad:
            raise ValueError(f"Qwen3-MoE cannot express this model: {fix} for HF interop")


def to_hf_config(cfg: ModelConfig, max_position_embeddings: int = 32768):
    """The transformers Qwen3MoeConfig of the identical architecture."""
    from transformers import Qwen3MoeConfig

    _check_supported(cfg)
    return Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.dense_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=max_position_embeddings, initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False, use_sliding_window=False, decoder_sparse_step=1,
        moe_intermediate_size=cfg.expert_hidden_size, num_experts_per_tok=cfg.top_k,
        num_experts=cfg.num_experts, norm_topk_prob=cfg.router_renormalize,
        router_aux_loss_coef=cfg.aux_loss_coeff, mlp_only_layers=list(range(cfg.first_k_dense)),
        use_cache=False,
    )


def _layer_names(cfg: ModelConfig, i: int) -> list[tuple[str, str, bool]]:
    """(our name, HF name, transpose the last two dims) for layer i."""
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    pairs = [(ours + a + ".weight", hf + b + ".weight", False) for a, b in _ATTN.items()]
    if i < cfg.first_k_dense:
        pairs += [(ours + a + ".weight", hf + b + ".weight", False) for a, b in _DENSE.items()]
    else:
        pairs += [(ours + a, hf + b, False) for a, b in _SHARED_MOE_NAMES.items()]
        pairs += [(ours + a, hf + b, True) for a, b in _EXPERTS.items()]
    return pairs


def _name_map(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    pairs = [("embed.weight", "model.embed_tokens.weight", False), ("norm.weight", "model.norm.weight", False)]
    for i in range(cfg.num_layers):
        pairs += _layer_names(cfg, i)
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight", False))
    return pairs


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """State dict loadable by transformers' Qwen3MoeForCausalLM (copies, the model's dtype)."""
    cfg = model.cfg
    _check_supported(cfg)
    ours = model.state_dict()
    out = {}
    for a, b, transpose in _name_map(cfg):
        t = ours[a].flatten(2) if a.endswith("experts.w_gate_up") else ours[a]
        out[b] = (t.transpose(-2, -1) if transpose else t).contiguous().clone()
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our model's state dict (load with model.load_state_dict) from a Qwen3MoeForCausalLM one."""
    _check_supported(cfg)
    pairs = _name_map(cfg)
    expected = {b for _, b, _ in pairs} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing, unexpected = expected - sd.keys(), sd.keys() - expected
    if missing or unexpected:
        raise ValueError(f"HF state dict does not match model config: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}; build cfg from the checkpoint's config")
    out = {a: (sd[b].transpose(-2, -1) if transpose else sd[b]).contiguous().clone() for a, b, transpose in pairs}
    for a in out:
        if a.endswith("experts.w_gate_up"):  # [E, D, 2F] -> [E, D, 2, F]
            out[a] = out[a].unflatten(2, (2, cfg.expert_hidden_size))
    for i in range(cfg.first_k_dense, cfg.num_layers):
        # The aux-loss-free bias is ours alone; HF routing corresponds to a zero bias.
        out[f"layers.{i}.ffn.router.expert_bias"] = torch.zeros(cfg.num_experts, dtype=torch.float32)
    return out
