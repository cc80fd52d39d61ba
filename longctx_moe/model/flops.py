"""Training FLOPs of the model for MFU: 6 * active matmul parameters per token (forward + backward,
the lm head included, the embedding lookup not) plus causal attention over each document's real
length (padding is not useful work and is not counted)."""

from __future__ import annotations

from data_packing.balance import token_pair_cost
from longctx_moe.model.config import ModelConfig


def attention_matmul_params(cfg: ModelConfig) -> int:
    """One layer's attention projection weights: q, k, v, o; for MLA the low-rank q (or plain q),
    the kv latent with the shared rope key, its per-head up-projection to k_nope and v, and o."""
    d = cfg.hidden_size
    if cfg.attention_type != "mla":
        return d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    h, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = cfg.q_lora_rank * (d + h * qk) if cfg.q_lora_rank else d * h * qk
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * d


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies with: attention, router, top-k experts, shared/dense MLPs, head."""
    d = cfg.hidden_size
    attn = attention_matmul_params(cfg)
    moe = d * cfg.num_experts + cfg.top_k * 3 * d * cfg.expert_hidden_size + 3 * d * cfg.shared_expert_hidden_size
    dense = 3 * d * cfg.dense_hidden_size
    ffn = cfg.first_k_dense * dense + cfg.num_moe_layers * moe
    return cfg.num_layers * attn + ffn + d * cfg.vocab_size


def attention_flops_per_pair(cfg: ModelConfig) -> int:
    """Training FLOPs of one causal (query, key <= query) pair over all layers and heads: QK^T
    costs 2 FLOPs per query/key head dim, PV 2 per value head dim (they differ under MLA), and
    the backward costs twice the forward."""
    heads, _, qk, v = cfg.attention_dims()
    return 3 * 2 * heads * (qk + v) * cfg.num_layers


def pair_cost_ratio(cfg: ModelConfig) -> float:
    """One causal pair's training FLOPs in units of one token's dense work (6 x active matmul
    parameters): the `data.cost_per_token_pair` that makes the loader's cost model FLOPs."""
    return attention_flops_per_pair(cfg) / (6 * active_matmul_params(cfg))


def model_flops(cfg: ModelConfig, doc_lengths: list[int]) -> float:
    """Training FLOPs (fwd + bwd) of one pass over documents of these real lengths."""
    tokens = sum(doc_lengths)
    pairs = sum(n * (n + 1) // 2 for n in doc_lengths)  # causal_pairs, in integers
    return float(token_pair_cost(tokens, pairs, 6 * active_matmul_params(cfg), attention_flops_per_pair(cfg)))
