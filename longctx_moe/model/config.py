"""ModelConfig: the architecture of the MoE transformer (owned by the model package)."""

from __future__ import annotations

from dataclasses import dataclass

from longctx_moe.choices import check_choice

# Allowed values of the string fields; validate() checks them.
CHOICES = {
    "router_score": ("softmax", "sigmoid"),
    "aux_loss_type": ("none", "switch", "seq"),
    "grouped_gemm": ("auto", "grouped_mm", "loop"),
    "expert_precision": ("auto", "autocast", "param"),
    "kernels": ("auto", "torch", "triton"),
}


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # GQA: num_heads % num_kv_heads == 0
    head_dim: int = 32
    qk_norm: bool = True  # RMSNorm on q and k per head (Qwen3 style)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_backend: str = "auto"  # see cp_attention.kernels: auto | torch_cpu | torch_varlen | flex | flash_attn | reference

    # Mixture of experts
    num_experts: int = 8
    top_k: int = 2
    expert_hidden_size: int = 128
    shared_expert_hidden_size: int = 0  # 0 = no shared expert
    first_k_dense: int = 0  # the first k layers use a dense MLP instead of MoE
    dense_hidden_size: int = 512
    router_score: str = "softmax"  # softmax | sigmoid
    router_renormalize: bool = True  # renormalise the top-k weights to sum to 1
    aux_loss_type: str = "seq"  # none | switch (per micro-batch) | seq (per document)
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3
    expert_bias: bool = False  # aux-loss-free balancing: a bias that affects selection only
    expert_bias_update_rate: float = 1e-3
    grouped_gemm: str = "auto"  # auto | grouped_mm | loop
    # Dtype of the expert GEMMs under autocast: autocast (bf16, weights cast every forward) | param
    # (the weights' own dtype, no casts) | auto (= autocast where the device has native bf16: with
    # rows padded per expert on CPU, bf16 experts are ~3x faster than fp32 there; = param on a CPU
    # without it, where bf16 is 20-30x slower; see longctx_moe.model.grouped_gemm).
    expert_precision: str = "auto"

    # Triton kernels (longctx_moe.kernels) for MoE permute/unpermute, router top-k, RMSNorm (+
    # residual add) and the log-prob/entropy head: auto (on CUDA when triton is installed) | torch
    # | triton (refused at start-up where it cannot run).
    kernels: str = "auto"

    # Cross-entropy over the vocabulary in chunks of this many tokens (bounds fp32 logits memory).
    loss_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        # Checked once, when the value is made: by the config loader, or by a library caller
        # building the section itself. The components that take it do not check it again.
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the key, its value and the fix."""
        for key, allowed in CHOICES.items():
            check_choice(f"model.{key}", getattr(self, key), allowed)
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "num_experts", "top_k", "expert_hidden_size", "loss_chunk_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be divisible by "
                             f"model.num_kv_heads={self.num_kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}; "
                             "lower top_k or raise num_experts")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"model.first_k_dense={self.first_k_dense} must lie in "
                             f"[0, model.num_layers={self.num_layers}]")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense
