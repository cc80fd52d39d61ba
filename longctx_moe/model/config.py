"""The model package's two sections of the training config: `ModelConfig` (model:), the
architecture of the MoE transformer, exactly what a Hugging Face config.json says of it
(hf/families.py writes and reads every field); and `BalanceConfig` (balance:), how training keeps
the experts' loads even (the router losses and the aux-loss-free bias update), which the model
computes but no config.json holds."""

from __future__ import annotations

from dataclasses import dataclass

from longctx_moe.choices import check_choice

# Allowed values of the string fields; validate() checks them.
CHOICES = {
    "router_score": ("softmax", "sigmoid"),
    "qk_norm_scope": ("head", "full"),
    "attention_type": ("gqa", "mla"),
    "expert_activation": ("swiglu", "clamped_swiglu"),
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
    init_std: float = 0.02  # the std of the random initial weights (config.json's initializer_range)

    # Mixture of experts
    num_experts: int = 8
    top_k: int = 2
    expert_hidden_size: int = 128
    shared_expert_hidden_size: int = 0  # 0 = no shared expert
    first_k_dense: int = 0  # the first k layers use a dense MLP instead of MoE
    # the dense MLP's width (config.json's intermediate_size in Qwen, GLM and DeepSeek; families
    # without dense layers keep this default)
    dense_hidden_size: int = 512
    router_score: str = "softmax"  # softmax | sigmoid
    router_renormalize: bool = True  # renormalise the top-k weights to sum to 1
    # aux-loss-free balancing (DeepSeek-V3): a bias that affects selection only, moved by
    # balance.expert_bias_update_rate
    expert_bias: bool = False

    # ---- Pretrained-family features (the HF families of longctx_moe.hf.families) ----
    # The Hugging Face model_type that export-hf and the weight exporter write; train.init_from
    # sets it (and every architecture key) from the directory's config.json.
    hf_family: str = "qwen3_moe"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2-MoE, GLM-4.5)
    # q/k RMSNorm per head (Qwen3, GLM-4.5) or over the whole q / k projection width (OLMoE).
    qk_norm_scope: str = "head"
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x w) (Qwen2-MoE)
    # Group-limited top-k (DeepSeek-V3, GLM-4.5): experts form router_groups groups, each group
    # is scored by the sum of its two best (biased) scores, and experts are picked from the
    # router_topk_groups best groups only. 1 group = plain top-k.
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (after renorm)
    # gpt-oss's MoE: a bias on the router logits (before scores and top-k); biases on the experts'
    # gate/up and down projections (experts.b_gate_up [E, 2, F], b_down [E, D]; not expert_bias,
    # the selection-only balancing bias); and the clamped SwiGLU of its experts,
    # (clamp(up, -l, l) + 1) * g * sigmoid(1.702 g) with g = clamp(gate, max=l), l = swiglu_limit.
    router_bias: bool = False
    expert_proj_bias: bool = False
    expert_activation: str = "swiglu"  # swiglu | clamped_swiglu
    swiglu_limit: float = 7.0  # clamped_swiglu's l

    # ---- Attention features of pretrained families (model.rope, cp_attention kernels) ----
    # Partial rotary (GLM-4.5): RoPE on the first int(head_dim * factor) dims of each head.
    partial_rotary_factor: float = 1.0
    # transformers' rope_scaling dict; type "yarn" (DeepSeek-V3) with factor,
    # original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim. None: plain.
    rope_scaling: dict | None = None
    # The context length config.json declares (HF's Qwen3-MoE default); the model reads it only
    # as YaRN's factor (max_position_embeddings / original_max_position_embeddings) when
    # rope_scaling gives none.
    max_position_embeddings: int = 32768
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in the softmax denominator
    # Sliding-window attention (gpt-oss): a query sees its `sliding_window` latest keys (itself
    # included) in layers whose layer_types entry is "sliding_attention"; 0 = no window.
    # layer_types None with a window = every layer windowed.
    sliding_window: int = 0
    layer_types: list | None = None  # per layer: "sliding_attention" | "full_attention"
    attention_out_bias: bool = False  # a bias on the output projection (gpt-oss)
    # Multi-head Latent Attention (DeepSeek-V3, model.mla) with attention_type=mla: q through a
    # rank-q_lora_rank bottleneck (0 = a plain q projection), k / v from a rank-kv_lora_rank
    # latent; q/k heads of qk_nope_head_dim + qk_rope_head_dim (the rope part of k shared by
    # all heads), v heads of v_head_dim. head_dim / num_kv_heads are not used by MLA layers.
    # The two latent norms use eps 1e-6, not norm_eps (model/mla.py).
    attention_type: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rope dims stored as interleaved pairs (DeepSeek-V3 default)

    def __post_init__(self) -> None:
        # Checked once, when the value is made: by the config loader, or by a library caller
        # building the section itself. The components that take it do not check it again.
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the key, its value and the fix."""
        for key, allowed in CHOICES.items():
            check_choice(f"model.{key}", getattr(self, key), allowed)
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "num_experts", "top_k", "expert_hidden_size", "max_position_embeddings"):
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
        self._validate_family_features()
        self._validate_attention_features()
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"model.first_k_dense={self.first_k_dense} must lie in "
                             f"[0, model.num_layers={self.num_layers}]")

    def _validate_family_features(self) -> None:
        g, tg = self.router_groups, self.router_topk_groups
        if g < 1 or self.num_experts % g:
            raise ValueError(f"model.router_groups={g} must be >= 1 and divide model.num_experts="
                             f"{self.num_experts}; choose a divisor")
        if not 1 <= tg <= g:
            raise ValueError(f"model.router_topk_groups={tg} must lie in [1, model.router_groups={g}]")
        if g > 1 and self.top_k > tg * (self.num_experts // g):
            raise ValueError(f"model.top_k={self.top_k} exceeds the experts of model.router_topk_groups="
                             f"{tg} groups of {self.num_experts // g}; raise router_topk_groups")
        if g > 1 and self.num_experts // g < 2:
            raise ValueError(f"model.router_groups={g} leaves fewer than 2 experts per group (a group "
                             "is scored by its two best experts); use fewer groups")
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"model.routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        if self.expert_activation == "swiglu" and self.swiglu_limit != 7.0:
            raise ValueError(f"model.swiglu_limit={self.swiglu_limit} is the limit of "
                             "expert_activation=clamped_swiglu; set that or drop swiglu_limit")
        if not self.swiglu_limit > 0:
            raise ValueError(f"model.swiglu_limit={self.swiglu_limit} must be > 0")
        if self.shared_expert_gate and self.shared_expert_hidden_size < 1:
            raise ValueError("model.shared_expert_gate=true needs a shared expert; set "
                             "model.shared_expert_hidden_size > 0")

    def _validate_attention_features(self) -> None:
        from longctx_moe.model.rope import RopeSpec

        rotary = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2:
            raise ValueError(f"model.partial_rotary_factor={self.partial_rotary_factor} must lie in "
                             f"(0, 1] and give an even rotary width (head_dim * factor = {rotary})")
        RopeSpec.from_config(rotary, self.rope_theta, self.rope_scaling, self.max_position_embeddings)
        if self.sliding_window < 0:
            raise ValueError(f"model.sliding_window={self.sliding_window} must be >= 0 (0 = none)")
        if self.attention_type == "mla":
            self._validate_mla()
        if self.layer_types is None:
            return
        kinds = ("sliding_attention", "full_attention")
        if len(self.layer_types) != self.num_layers or any(k not in kinds for k in self.layer_types):
            raise ValueError(f"model.layer_types must list {self.num_layers} entries (num_layers) "
                             f"from {kinds}; got {self.layer_types}")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ValueError("model.layer_types has sliding_attention layers but "
                             "model.sliding_window is 0; set the window size")

    def _validate_mla(self) -> None:
        from longctx_moe.model.rope import RopeSpec

        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.attention_type=mla needs model.{key} >= 1")
        if self.qk_rope_head_dim % 2 or self.q_lora_rank < 0:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even and "
                             f"model.q_lora_rank={self.q_lora_rank} >= 0 (0 = no q bottleneck)")
        if self.qkv_bias or self.attention_out_bias or self.qk_norm:
            raise ValueError("model.attention_type=mla has no q/k/v/output biases or q/k norm; "
                             "set model.qkv_bias, attention_out_bias and qk_norm to false")
        RopeSpec.from_config(self.qk_rope_head_dim, self.rope_theta, self.rope_scaling,
                             self.max_position_embeddings)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def attention_dims(self) -> tuple[int, int, int, int]:
        """(query heads, K/V heads, query/key head size, value head size) of the tensors the
        attention kernels and the CP executors get. MLA up-projects K and V per head (kv_b), so
        it has as many K/V heads as query heads, of nope + rope and of v_head_dim."""
        if self.attention_type == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            return self.num_heads, self.num_heads, qk, self.v_head_dim
        return self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim

    def window_of(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx` (None: full causal attention)."""
        if self.sliding_window < 1:
            return None
        if self.layer_types is not None and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense


@dataclass
class BalanceConfig:
    """The `balance:` section: how training balances the experts' loads. Not architecture (a
    checkpoint resumes under other values, HF export writes none of it); the model takes it as a
    constructor argument, Transformer(cfg, ops, balance), and adds the losses it computes."""

    # The router's balance loss: none | switch (over each micro-batch, Switch Transformer) |
    # seq (per document, DeepSeek-V3), times aux_loss_coeff
    aux_loss_type: str = "seq"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3  # the router z-loss (mean squared logsumexp of the logits); 0 = off
    # Aux-loss-free balancing (model.expert_bias): each optimizer step moves every expert's
    # selection bias by this much toward the mean load
    expert_bias_update_rate: float = 1e-3

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the key, its value and the fix."""
        check_choice("balance.aux_loss_type", self.aux_loss_type, ("none", "switch", "seq"))
        for key in ("aux_loss_coeff", "z_loss_coeff", "expert_bias_update_rate"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"balance.{key}={getattr(self, key)} must be >= 0 (0 = off)")
