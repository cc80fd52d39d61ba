"""Training FLOPs of the model for MFU: 6 * active matmul parameters per token (forward + backward,
the lm head included, the embedding lookup not) plus causal attention over each document's real
length (padding is not useful work and is not counted)."""

from __future__ import annotations

from longctx_moe.model.config import ModelConfig


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies with: attention, router, top-k experts, shared/dense MLPs, head."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o and k, v projections
    moe = d * cfg.num_experts + cfg.top_k * 3 * d * cfg.expert_hidden_size + 3 * d * cfg.shared_expert_hidden_size
    dense = 3 * d * cfg.dense_hidden_size
    ffn = cfg.first_k_dense * dense + cfg.num_moe_layers * moe
    return cfg.num_layers * attn + ffn + d * cfg.vocab_size


def attention_flops_per_pair(cfg: ModelConfig) -> int:
    """Training FLOPs of one causal (query, key <= query) pair over all layers and heads: QK^T and
    PV cost 2 FLOPs per head dim each, and the backward costs twice the forward."""
    return 3 * 2 * 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers


def pair_cost_ratio(cfg: ModelConfig) -> float:
    """One causal pair's training FLOPs in units of one token's dense work (6 x active matmul
    parameters): the `data.cost_per_token_pair` that makes the loader's cost model FLOPs."""
    return attention_flops_per_pair(cfg) / (6 * active_matmul_params(cfg))


def model_flops(cfg: ModelConfig, doc_lengths: list[int]) -> float:
    """Training FLOPs (fwd + bwd) of one pass over documents of these real lengths."""
    tokens = sum(doc_lengths)
    pairs = sum(n * (n + 1) // 2 for n in doc_lengths)
    return float(6 * active_matmul_params(cfg) * tokens + attention_flops_per_pair(cfg) * pairs)
