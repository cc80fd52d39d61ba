"""The MoE transformer on packed documents, and the API the trainer calls.

`model(batch, layout=None, head=None) -> ForwardOutput`. Without `head` the output carries the
fused cross-entropy sum (supervised training: logits' gradients are formed chunk by chunk in the
forward). With `head=LogProbHead(...)` it carries per-token log-probs (and entropies) with
gradients, for losses that weigh every token on its own (RL); ce_sum is then -sum(logp) so both
heads serve the same trainer. Routes taken by every token are always returned (router replay
records them); `layout.replay_TLK` replays given ones.

Shapes: T physical tokens, D model dim, V vocabulary, L MoE layers, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from data_packing.batch import PackedBatch
from longctx_moe.execution import Ops, default_ops
from longctx_moe.model.attention import Attention, DocLayout, doc_layout
from longctx_moe.model.config import BalanceConfig, ModelConfig
from longctx_moe.model.fp8 import apply_fp8
from longctx_moe.model.layers import RMSNorm, SwiGLU, autocast_dtype
from longctx_moe.model.losses import VocabShard, chunked_cross_entropy, chunked_token_logprobs
from longctx_moe.model.mla import MLAttention
from longctx_moe.model.moe import MoE, MoEStats
from longctx_moe.model.recompute import BlockRecompute, recompute_call


@dataclass
class ForwardOutput:
    # fp32 scalar: sum over target tokens of (loss_weight *) cross-entropy; the count to divide
    # by is the caller's (PackedBatch.num_target_tokens, summed over the step)
    ce_sum: torch.Tensor
    aux_loss: torch.Tensor  # scalar, already times balance.aux_loss_coeff, summed over MoE layers
    z_loss: torch.Tensor  # scalar, already times balance.z_loss_coeff, summed over MoE layers
    expert_counts: torch.Tensor  # int64 [L, E]: real tokens routed per expert after top-k
    routes_TLK: torch.Tensor | None = None  # int64 [T, L, K]: experts of every token and layer
    logprobs_T: torch.Tensor | None = None  # LogProbHead: log p(label_t), 0 where label is -100
    entropy_T: torch.Tensor | None = None  # LogProbHead(entropy=True): entropy at each target
    replay: dict = field(default_factory=dict)  # router replay: {"known": n, "agree": n} tokens


@dataclass(frozen=True)
class LogProbHead:
    """Ask the model for per-token log-probs (at temperature) and optionally entropies;
    `balance_losses=False` when the routers' aux and z losses will not be read (scoring without
    training: they are then 0)."""

    temperature: float = 1.0
    entropy: bool = False
    balance_losses: bool = True


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + ffn(norm(x)) where ffn is MoE or a dense SwiGLU.

    The block ends before its last add: it returns the stream and the FFN's output h apart, and
    the next block's attention norm (`branch_TD`) adds them, in one kernel with the norm when it
    runs in Triton, whose backward writes the bf16 h's gradient in the pass that forms the fp32
    stream's, where autograd's add would cast it in another (the ffn norm adds the attention's
    output the same way). The sums and their roundings are those of `x + h`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: Ops, balance: BalanceConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ops.norm)
        self.attn = (MLAttention if cfg.attention_type == "mla" else Attention)(cfg, layer_idx, ops)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ops.norm)
        self.is_moe = layer_idx >= cfg.first_k_dense
        self.ffn = MoE(cfg, ops, balance) if self.is_moe else SwiGLU(cfg.hidden_size, cfg.dense_hidden_size,
                                                                         ops.swiglu)

    def forward(self, x_TD: torch.Tensor, layout: DocLayout, replay_TK: torch.Tensor | None = None,
                branch_TD: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, MoEStats | None]:
        """-> (x_TD, h_TD, stats): the stream after the attention, the FFN's output (the block's
        output is their sum), the MoE statistics. `branch_TD`: the previous block's h_TD."""
        if branch_TD is None:
            n_TD = self.attn_norm(x_TD)
        else:
            x_TD, n_TD = self.attn_norm(x_TD, residual=branch_TD)
        x_TD, n_TD = self.ffn_norm(x_TD, residual=self.attn(n_TD, layout))
        if self.is_moe:
            h_TD, stats = self.ffn(n_TD, layout, replay_TK)
        else:
            h_TD, stats = self.ffn(n_TD), None
        return x_TD, h_TD, stats


class Transformer(nn.Module):
    """`cfg`: what the model is (architecture); `ops`: how it runs (longctx_moe.execution,
    resolved once at start-up; default: a default run on the CPU); `balance`: the routers'
    balance losses and bias rate that training uses (default: BalanceConfig())."""

    def __init__(self, cfg: ModelConfig, ops: Ops | None = None, balance: BalanceConfig | None = None):
        super().__init__()
        ops = default_ops() if ops is None else ops
        balance = BalanceConfig() if balance is None else balance
        self.cfg, self.ops, self.balance = cfg, ops, balance
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg, i, ops, balance) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ops.norm)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # activation recompute (longctx_moe.model.recompute): none | selective | full
        self.recompute = ops.recompute
        # A vocab-parallel head (set by parallelize under TP): output_weight() then holds this
        # rank's rows and the losses reduce their softmax statistics over the shard's group.
        self.vocab_shard: VocabShard | None = None
        apply_fp8(self, ops.fp8, ops.fp8_recipe, ops.fp8_amax_history)

    def output_weight(self) -> torch.Tensor:
        """[V, D] projection to the vocabulary (the embedding when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def _run(self, batch: PackedBatch, layout: DocLayout | None) -> tuple[torch.Tensor, list[MoEStats]]:
        # The parallel runtime passes the layout of this rank's shard (global document ids, the
        # CP executor, the statistics reduction); on one device it is built from the batch.
        layout = doc_layout(batch) if layout is None else layout
        if layout.position_ids_T.shape[0] != batch.num_tokens:
            raise ValueError(f"the layout describes {layout.position_ids_T.shape[0]} tokens but the "
                             f"batch has {batch.num_tokens}; run the model on the shard the layout "
                             "was built with (runtime.shard)")
        x_TD = self.embed(batch.tokens)
        # Fill the RoPE cache before the blocks, so that every block (compiled or not) only reads it.
        layout.rope_cos_sin(self.cfg.head_dim, self.cfg.rope_theta, autocast_dtype(x_TD))
        stats = []
        replay_TLK = layout.replay_TLK
        h_TD = None  # the last block's FFN output, not yet added to the stream (Block)
        for block in self.layers:
            replay_TK = None if replay_TLK is None or not block.is_moe else replay_TLK[:, len(stats)]
            if self.recompute == "full" and torch.is_grad_enabled():
                # A recomputed block keeps only its inputs: the stream summed, not stream and branch.
                x_TD = x_TD if h_TD is None else x_TD + h_TD
                x_TD, h_TD, s = recompute_call(BlockRecompute(block), x_TD, layout, replay_TK)
            else:
                x_TD, h_TD, s = block(x_TD, layout, replay_TK, h_TD)
            if s is not None:
                stats.append(s)
        # A plain add before the final norm: sequence parallelism's hook gathers its one output.
        return self.norm(x_TD if h_TD is None else x_TD + h_TD), stats

    def hidden_states(self, batch: PackedBatch, layout: DocLayout | None = None) -> torch.Tensor:
        """x_TD after the final norm (fp32 residual stream under autocast)."""
        return self._run(batch, layout)[0]

    def logits(self, batch: PackedBatch, layout: DocLayout | None = None) -> torch.Tensor:
        """logits_TV over the whole vocabulary (HF parity tests); training uses forward().
        Not differentiable through a vocab-parallel head (its columns are gathered)."""
        z_TV = torch.nn.functional.linear(self.hidden_states(batch, layout), self.output_weight())
        return z_TV if self.vocab_shard is None else self.vocab_shard.gather_columns(z_TV)

    def forward(self, batch: PackedBatch, layout: DocLayout | None = None,
                head: LogProbHead | None = None) -> ForwardOutput:
        if head is not None and not head.balance_losses:
            layout = replace(doc_layout(batch) if layout is None else layout, balance_losses=False)
        h_TD, stats = self._run(batch, layout)
        logp_T = ent_T = None
        if head is None:
            ce_sum = chunked_cross_entropy(h_TD, self.output_weight(), batch.labels, batch.loss_weight,
                                           self.ops.loss_chunk_tokens, self.vocab_shard, self.ops.logprobs)
        else:
            logp_T, ent_T = chunked_token_logprobs(h_TD, self.output_weight(), batch.labels,
                                                   self.ops.loss_chunk_tokens, head.temperature,
                                                   head.entropy, self.vocab_shard, self.ops.logprobs,
                                                   self.ops.loss_logits_cache_mb)
            w_T = logp_T if batch.loss_weight is None else logp_T * batch.loss_weight
            ce_sum = -w_T.sum()
        zero = h_TD.new_zeros((), dtype=torch.float32)
        e, t = self.cfg.num_experts, batch.num_tokens
        counts = (torch.stack([s.counts_E for s in stats]) if stats
                  else torch.zeros(0, e, dtype=torch.int64, device=h_TD.device))
        routes = (torch.stack([s.topk_idx_TK for s in stats], 1) if stats
                  else torch.zeros(t, 0, self.cfg.top_k, dtype=torch.int64, device=h_TD.device))
        return ForwardOutput(
            ce_sum=ce_sum,
            aux_loss=sum((s.aux_loss for s in stats), zero),
            z_loss=sum((s.z_loss for s in stats), zero),
            expert_counts=counts, routes_TLK=routes, logprobs_T=logp_T, entropy_T=ent_T,
            replay={"known": sum(s.replay_known for s in stats),
                    "agree": sum(s.replay_agree for s in stats)},
        )

    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers if b.is_moe]

    @torch.no_grad()
    def update_expert_bias(self, counts_LE: torch.Tensor) -> None:
        """Once per optimizer step with the step's expert counts (int [L, E], summed over the step's
        micro-batches and data-parallel ranks). A no-op unless cfg.expert_bias."""
        moe = self.moe_layers()
        if tuple(counts_LE.shape) != (len(moe), self.cfg.num_experts):
            raise ValueError(f"update_expert_bias: counts of shape {tuple(counts_LE.shape)}, expected "
                             f"[num_moe_layers={len(moe)}, num_experts={self.cfg.num_experts}]; pass "
                             "the sum of ForwardOutput.expert_counts over the step")
        if not self.cfg.expert_bias:
            return
        for layer, counts_E in zip(moe, counts_LE, strict=True):
            layer.router.update_bias(counts_E)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for every matrix, ones for norms, zero expert bias."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        for layer in self.moe_layers():
            layer.router.expert_bias.zero_()


def build_model(cfg: ModelConfig, ops: Ops | None = None, balance: BalanceConfig | None = None) -> Transformer:
    """A randomly initialised Transformer (deterministic under torch.manual_seed), fp32 on CPU."""
    model = Transformer(cfg, ops, balance)
    model.init_weights()
    return model


__all__ = ["Block", "ForwardOutput", "LogProbHead", "Transformer", "build_model"]
