"""Multi-head Latent Attention (DeepSeek-V3), in transformers' DeepseekV3Attention layout.

    q = q_b(norm_qa(q_a(x)))  (or q_proj(x) without q_lora_rank)  -> per head [nope | rope]
    kv_a(x) = [c_kv | k_rope]: c_kv (kv_lora_rank) -> norm_kva -> kv_b -> per head [k_nope | v]
    (norm_qa and norm_kva use eps 1e-6 whatever model.norm_eps says, as DeepSeek-V3 does)
    k_rope (one head, shared by all) and q's rope part get RoPE (YaRN in DeepSeek-V3);
    k = [k_nope | k_rope], attention with q/k head dim nope + rope and v head dim v_head_dim,
    softmax scale (nope + rope)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2.

The varlen kernels take the value head dim as it is (cp_attention pads where a kernel needs one
head dim), so nothing is expanded to the q/k width. Tensor parallelism splits q_b (or q_proj),
kv_b and o_proj by heads and keeps the low-rank down-projections and their norms whole on every
rank (tensor_parallel.shard_mla).

Shape legend: T tokens, D model dim, H heads, N nope dims, P rope dims, V value dims,
Cq / Ckv the q / kv latent ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx_moe.execution import Ops
from longctx_moe.kernels import triton_ops
from longctx_moe.model.attention import DocLayout, attend
from longctx_moe.model.config import ModelConfig
from longctx_moe.model.layers import RMSNorm
from longctx_moe.model.rope import RopeSpec, apply_partial_rope, yarn_softmax_scale_factor

# DeepSeek-V3 builds its two latent norms with RMSNorm's default eps, not rms_norm_eps (its
# reference code and transformers' DeepseekV3Attention alike): a checkpoint whose rms_norm_eps
# is not 1e-6 still normalises its latents with 1e-6.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """DeepSeek-V3 attention (see the module docstring); weight names follow transformers'."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, ops: Ops | None = None):
        super().__init__()
        ops = Ops() if ops is None else ops
        d, h = cfg.hidden_size, cfg.num_heads
        self.num_heads = h
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, ops.norm)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, ops.norm)
        self.kv_b_proj = nn.Linear(self.kv_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        self.rope_spec = RopeSpec.from_config(self.rope_dim, cfg.rope_theta, cfg.rope_scaling,
                                              cfg.max_position_embeddings)
        self.rope_interleave = cfg.rope_interleave
        self.rope_impl = ops.rope  # torch | triton (q and k in one launch: kernels/triton_rope.py)
        self.scale = qk ** -0.5 * yarn_softmax_scale_factor(cfg.rope_scaling)
        self.window = cfg.window_of(layer_idx)
        self.sinks = nn.Parameter(torch.zeros(h)) if cfg.attention_sinks else None
        self.backend = ops.attention

    def _queries(self, x_TD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_TD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        # Head count from the weights: TP keeps this rank's heads of q_b / q_proj.
        return q.view(x_TD.shape[0], -1, self.nope + self.rope_dim)

    def _rope_qk(self, q_THP: torch.Tensor, k_T1P: torch.Tensor, layout: DocLayout):
        """q's and k's rope parts rotated: one Triton launch, or the torch path on each."""
        if self.rope_impl == "triton":
            cos_TP, sin_TP = layout.rope_tables(self.rope_spec, q_THP.dtype)
            return triton_ops().rope(q_THP, k_T1P, cos_TP, sin_TP, self.rope_interleave)
        return self._rope(q_THP, layout), self._rope(k_T1P, layout)

    def _rope(self, x_THP: torch.Tensor, layout: DocLayout) -> torch.Tensor:
        if self.rope_interleave:  # pairs (0, 1), (2, 3)... -> rotate-half's (i, i + P/2)
            t, h, p = x_THP.shape
            x_THP = x_THP.view(t, h, p // 2, 2).transpose(-1, -2).reshape(t, h, p)
        cos_TP, sin_TP = layout.rope_tables(self.rope_spec, x_THP.dtype)
        return apply_partial_rope(x_THP, cos_TP, sin_TP)

    def forward(self, x_TD: torch.Tensor, layout: DocLayout) -> torch.Tensor:
        t = x_TD.shape[0]
        q_THQ = self._queries(x_TD)
        ckv_TC, k_rope_TP = self.kv_a_proj_with_mqa(x_TD).split([self.kv_rank, self.rope_dim], -1)
        kv_THX = self.kv_b_proj(self.kv_a_layernorm(ckv_TC)).view(t, -1, self.nope + self.v_dim)
        k_nope_THN, v_THV = kv_THX.split([self.nope, self.v_dim], -1)
        q_nope_THN, q_rope_THP = q_THQ.split([self.nope, self.rope_dim], -1)
        q_rope_THP, k_rope_T1P = self._rope_qk(q_rope_THP, k_rope_TP[:, None, :], layout)
        h = q_THQ.shape[1]
        q = torch.cat([q_nope_THN, q_rope_THP], -1)
        k = torch.cat([k_nope_THN, k_rope_T1P.expand(t, h, self.rope_dim)], -1)
        out_THV = attend(q, k, v_THV.contiguous(), layout, self.backend, self.window, self.sinks,
                         scale=self.scale)
        return self.o_proj(out_THV.reshape(t, -1))
