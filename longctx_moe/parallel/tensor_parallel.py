"""Tensor parallelism (Megatron style) applied to a built Transformer, without editing model code.

Attention: wq / wk / wv keep this rank's heads (column-parallel), wo keeps the matching input
columns (row-parallel). With tp > num_kv_heads each KV head is replicated over the tp/num_kv_heads
ranks whose query heads read it: wk / wv become `ReplicatedKVLinear`, which stores an ordinary
1/tp row shard of the whole projection and all-gathers it per forward (its backward sums the
gradient over TP and keeps the rank's rows), so checkpoints, export and the gradient norm see a
plain `tp` split along dim 0 and a replicated head is never stored or updated twice.

Dense SwiGLU MLPs (first_k_dense layers, shared experts): w_gate / w_up column-parallel, w_down
row-parallel. Each sharded module gets Megatron's conjugate pair as hooks: `copy` on its input
(identity forward, all-reduce of the gradient over TP backward) and `reduce` on its output
(all-reduce forward, identity backward), so parameter names stay unchanged. With sequence
parallelism the pair becomes all-gather / reduce-scatter of tokens (sequence_parallel.py).

Replicated parameters fed by local heads only (the per-head q/k RMSNorm weights) get partial
gradients on each TP rank: they are tagged reduce_axis = "world" (TP x CP x DP). Sharded ones
declare a `tp` split (sharding.declare_split: the dimension whose global size is tp x the local
one, rank r holding the r-th slice), which the gradient norm, the checkpoint and the exporter read.

Vocabulary: the embedding and the LM head keep rows [r V/tp, (r+1) V/tp) (a `tp` split along dim 0). The
embedding becomes `VocabParallelEmbedding` (a lookup of the ids this rank holds, all-reduced over
TP); the head's losses get the TP group through `model.vocab_shard` and reduce the softmax
statistics per chunk (model/losses.py), so no rank forms [T, V]. The final norm and the routers
are replicated over TP; without sequence parallelism their gradients are complete on every TP
rank, with it they are partial (each rank's own tokens) and summed over "world" (see
sequence_parallel.py). Experts are sliced by EP / ETP (expert_parallel.py), not here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longctx_moe.model.losses import VocabShard
from longctx_moe.parallel.comm import sum_over_group
from longctx_moe.parallel.dims import Axis
from longctx_moe.parallel.sequence_parallel import (
    add_sequence_parallel_hooks,
    apply_sequence_parallel,
    scatter_tokens,
)
from longctx_moe.parallel.sharding import declare_split


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _add_tp_hooks(module: nn.Module, group, sequence_parallel: bool = False, regather=None) -> None:
    if sequence_parallel:  # tokens split between the regions: all-gather / reduce-scatter
        add_sequence_parallel_hooks(module, group, regather)
        return
    module.register_forward_pre_hook(lambda m, args: (_CopyToTP.apply(args[0], group), *args[1:]))
    module.register_forward_hook(lambda m, args, out: sum_over_group(out, group))


class _GatherRowShards(torch.autograd.Function):
    """[n, D] row shard of every TP rank -> the whole [tp n, D] weight. Backward: the gradients
    of the whole weight summed over TP (each rank's covers the rows it used), this rank's rows."""

    @staticmethod
    def forward(ctx, w_nD, group, rank):
        ctx.group, ctx.rank, ctx.n = group, rank, w_nD.shape[0]
        parts = [torch.empty_like(w_nD) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, w_nD.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(0, ctx.rank * ctx.n, ctx.n), None, None


class _SumBothWays(torch.autograd.Function):
    """All-reduce (sum) over TP whose backward is the all-reduce of the gradients too: every rank
    uses the sum for its own slice, so each rank's gradient of it is partial."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class WidthShardedRMSNorm(nn.Module):
    """A q or k RMSNorm over the whole projection width (OLMoE) when TP keeps this rank's heads:
    the weight keeps the rank's columns [start, start + n) (a tp split of dim 0), and the mean of
    squares is summed over TP before it normalises the rank's slice. Legend: T tokens, X the
    rank's width, W the whole width."""

    def __init__(self, norm: nn.Module, start: int, n: int, group):
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach()[start:start + n].clone(),
                                   requires_grad=norm.weight.requires_grad)
        _tag(self.weight, 0, start // n, norm.weight.shape[0] // n)
        self.eps, self.width, self.group = norm.eps, norm.weight.shape[0], group

    def forward(self, x_TX: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if x_TX.dtype == torch.float64 else torch.float32
        x = x_TX.to(dtype)
        ss_T1 = _SumBothWays.apply(x.square().sum(-1, keepdim=True), self.group)
        y = x * torch.rsqrt(ss_T1 / self.width + self.eps) * self.weight.to(dtype)
        return y.to(x_TX.dtype)


def _tag(p: nn.Parameter, dim: int, rank: int, size: int) -> None:
    declare_split(p, Axis.TP, dim, size, rank)  # global size = tp x local along `dim`


@torch.no_grad()
def _keep(linear: nn.Module, dim: int, start: int, stop: int) -> None:
    """Keep rows (dim 0: output features) or columns (dim 1: input features) [start, stop)."""
    size = linear.weight.shape[dim] // (stop - start)
    w = linear.weight.narrow(dim, start, stop - start).clone()
    linear.weight = nn.Parameter(w, requires_grad=linear.weight.requires_grad)
    _tag(linear.weight, dim, start // (stop - start), size)
    if getattr(linear, "bias", None) is not None and dim == 0:  # a bias follows its output rows
        linear.bias = nn.Parameter(linear.bias.narrow(0, start, stop - start).clone(),
                                   requires_grad=linear.bias.requires_grad)
        _tag(linear.bias, 0, start // (stop - start), size)
    if dim == 0:
        linear.out_features = stop - start
    elif hasattr(linear, "in_features"):
        linear.in_features = stop - start


class ReplicatedKVLinear(nn.Module):
    """wk or wv when tp > num_kv_heads: projects onto the one KV head (`head`) that this rank's
    query heads read. Stores rows [rank n, (rank+1) n) of the whole [G R, D] projection
    (n = G R / tp) and all-gathers them per forward: a replicated head's gradient is then summed
    over the ranks sharing it by the gather's backward, and each row is stored once."""

    def __init__(self, linear: nn.Linear, head: int, head_dim: int, rank: int, size: int, group):
        super().__init__()
        n = linear.out_features // size
        self.weight = nn.Parameter(linear.weight.detach()[rank * n:(rank + 1) * n].clone(),
                                   requires_grad=linear.weight.requires_grad)
        _tag(self.weight, 0, rank, size)
        self.bias = None
        if linear.bias is not None:  # stored and gathered like the weight's rows
            self.bias = nn.Parameter(linear.bias.detach()[rank * n:(rank + 1) * n].clone(),
                                     requires_grad=linear.bias.requires_grad)
            _tag(self.bias, 0, rank, size)
        self.head, self.head_dim, self.rank, self.group = head, head_dim, rank, group

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        rows = slice(self.head * self.head_dim, (self.head + 1) * self.head_dim)
        w_GRD = _GatherRowShards.apply(self.weight, self.group, self.rank)
        b_R = None if self.bias is None else _GatherRowShards.apply(self.bias, self.group, self.rank)[rows]
        return F.linear(x_TD, w_GRD[rows], b_R)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding whose rows [start, start + V/tp) live on this TP rank: ids outside them give
    zeros, and the all-reduce over TP (identity backward) assembles every token's vector (a
    reduce-scatter to this rank's tokens under sequence parallelism). The weight keeps the name
    `weight`, so state-dict keys do not change."""

    def __init__(self, embed: nn.Embedding, rank: int, size: int, group,
                 sequence_parallel: bool = False):
        super().__init__()
        n = embed.num_embeddings // size
        self.start, self.group, self.sequence_parallel = rank * n, group, sequence_parallel
        self.weight = nn.Parameter(embed.weight.detach()[self.start:self.start + n].clone(),
                                   requires_grad=embed.weight.requires_grad)
        _tag(self.weight, 0, rank, size)

    def forward(self, tokens_T: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        local_T = tokens_T - self.start
        own_T = (local_T >= 0) & (local_T < n)
        x_TD = F.embedding(local_T.clamp(0, n - 1), self.weight)
        x_TD = torch.where(own_T[:, None], x_TD, torch.zeros_like(x_TD))
        if self.sequence_parallel:
            return scatter_tokens(x_TD, self.group)
        return sum_over_group(x_TD, self.group)


def shard_vocabulary(model: nn.Module, rank: int, size: int, group,
                     sequence_parallel: bool = False) -> None:
    """Embedding and LM head (or the tied embedding alone) split by vocabulary rows."""
    model.embed = VocabParallelEmbedding(model.embed, rank, size, group, sequence_parallel)
    if model.lm_head is not None:
        v = model.lm_head.out_features // size
        _keep(model.lm_head, 0, rank * v, (rank + 1) * v)
    model.vocab_shard = VocabShard(group, model.embed.start)


def shard_attention(attn: nn.Module, rank: int, size: int, group,
                    sequence_parallel: bool = False, regather=None) -> None:
    """Heads [rank*H/size, (rank+1)*H/size) and their kv heads; GQA grouping is preserved. With
    size > G, the one KV head of this rank's query heads (replicated over size/G ranks).
    `regather`: see sequence_parallel.add_sequence_parallel_hooks."""
    h, g, r = attn.num_heads, attn.num_kv_heads, attn.head_dim
    hq = h // size
    _keep(attn.wq, 0, rank * hq * r, (rank + 1) * hq * r)
    if g % size == 0:
        hk = g // size
        _keep(attn.wk, 0, rank * hk * r, (rank + 1) * hk * r)
        _keep(attn.wv, 0, rank * hk * r, (rank + 1) * hk * r)
    else:
        head = rank * g // size  # query head i reads kv head i // (H/G)
        attn.wk = ReplicatedKVLinear(attn.wk, head, r, rank, size, group)
        attn.wv = ReplicatedKVLinear(attn.wv, head, r, rank, size, group)
    _keep(attn.wo, 1, rank * hq * r, (rank + 1) * hq * r)
    bias_after_reduce = attn.wo.bias is not None
    if bias_after_reduce:
        attn.wo = RowParallelLinear(attn.wo)
    _keep_sinks(attn, rank * hq, (rank + 1) * hq, size)
    if attn.norm_full_width and attn.q_norm is not None:  # checked: the KV heads split here
        attn.q_norm = WidthShardedRMSNorm(attn.q_norm, rank * hq * r, hq * r, group)
        attn.k_norm = WidthShardedRMSNorm(attn.k_norm, rank * (g // size) * r, (g // size) * r, group)
    for norm in () if attn.norm_full_width else (attn.q_norm, attn.k_norm):
        for p in norm.parameters() if norm is not None else ():
            p.reduce_axis = Axis.WORLD  # partial per TP rank: sums over TP as well as DP x CP
    _add_tp_hooks(attn, group, sequence_parallel, regather)
    if bias_after_reduce:  # registered after the reduction's hook, so it runs after it
        attn.register_forward_hook(lambda m, args, out: out + m.wo.bias.to(out.dtype))
        if sequence_parallel:  # added to this rank's own tokens only: partial per TP rank
            attn.wo.bias.reduce_axis = Axis.WORLD


class RowParallelLinear(nn.Module):
    """A row-parallel projection (this rank's input columns) that leaves its bias out: the
    attention's TP hook adds it once, after the sum over TP (gpt-oss's o_proj bias). Holds the
    same `weight` and `bias` parameters, so names and declared splits stay those of the Linear."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


@torch.no_grad()
def _keep_sinks(attn: nn.Module, start: int, stop: int, size: int) -> None:
    """gpt-oss sinks are one logit per query head: they follow the heads [start, stop)."""
    if getattr(attn, "sinks", None) is not None:
        attn.sinks = nn.Parameter(attn.sinks[start:stop].clone(),
                                  requires_grad=attn.sinks.requires_grad)
        _tag(attn.sinks, 0, start // (stop - start), size)


def shard_mla(attn: nn.Module, rank: int, size: int, group, sequence_parallel: bool = False,
              regather=None) -> None:
    """MLA (model.mla): heads [rank*H/size, (rank+1)*H/size) of q_b (or q_proj), kv_b and
    o_proj; the low-rank down-projections and their norms stay whole on every rank, their
    gradients partial per TP rank (each covers this rank's heads), so summed over TP too."""
    hq = attn.num_heads // size
    qk, kv = attn.nope + attn.rope_dim, attn.nope + attn.v_dim
    q_up = attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj
    _keep(q_up, 0, rank * hq * qk, (rank + 1) * hq * qk)
    _keep(attn.kv_b_proj, 0, rank * hq * kv, (rank + 1) * hq * kv)
    _keep(attn.o_proj, 1, rank * hq * attn.v_dim, (rank + 1) * hq * attn.v_dim)
    _keep_sinks(attn, rank * hq, (rank + 1) * hq, size)
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        for p in getattr(attn, name).parameters() if hasattr(attn, name) else ():
            p.reduce_axis = Axis.WORLD
    _add_tp_hooks(attn, group, sequence_parallel, regather)


def shard_swiglu(mlp: nn.Module, rank: int, size: int, group,
                 sequence_parallel: bool = False, regather=None) -> None:
    """Hidden units [rank*F/size, (rank+1)*F/size) of a dense SwiGLU."""
    f = mlp.w_gate.out_features
    lo, hi = rank * f // size, (rank + 1) * f // size
    _keep(mlp.w_gate, 0, lo, hi)
    _keep(mlp.w_up, 0, lo, hi)
    _keep(mlp.w_down, 1, lo, hi)
    if getattr(mlp, "gate", None) is not None:  # a gated shared expert: scales partial sums
        mlp.gate.weight.reduce_axis = Axis.WORLD
    _add_tp_hooks(mlp, group, sequence_parallel, regather)


def _dense_mlps(block: nn.Module) -> list[nn.Module]:
    if not block.is_moe:
        return [block.ffn]
    return [block.ffn.shared] if block.ffn.shared is not None else []


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """One-line errors for shapes TP over `size` ranks cannot split (before any sharding)."""
    v = model.embed.num_embeddings
    if v % size:
        raise ValueError(f"the vocabulary-parallel embedding and LM head split vocab_size={v} "
                         f"over tp={size}; pad vocab_size to a multiple of tp")
    for block in model.layers:
        if hasattr(block.attn, "kv_b_proj"):  # MLA: heads split, down-projections whole
            _check_mla(block.attn.num_heads, size)
        else:
            _check_gqa(block.attn, size)
        for mlp in _dense_mlps(block):
            if mlp.w_gate.out_features % size:
                raise ValueError(f"a dense MLP of hidden size {mlp.w_gate.out_features} cannot "
                                 f"be split over tp={size}; choose tp dividing dense_hidden_size "
                                 "and shared_expert_hidden_size")


def _check_gqa(attn: nn.Module, size: int) -> None:
    h, g, r = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if attn.norm_full_width and attn.q_norm is not None and g % size:
        raise ValueError(f"model.qk_norm_scope=full (OLMoE) normalises k over all KV heads, but "
                         f"tp={size} replicates num_kv_heads={g}; choose a tp dividing num_kv_heads")
    if h % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs num_heads={h} divisible "
                         "by tp; choose tp dividing num_heads")
    if g % size and (size % g or g * r % size):
        raise ValueError(f"tp={size} with num_kv_heads={g}, head_dim={r}: KV heads are split "
                         "when tp divides num_kv_heads, or replicated when num_kv_heads "
                         "divides tp and tp divides num_kv_heads*head_dim; choose such a tp")


def _check_mla(heads: int, size: int) -> None:
    if heads % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs num_heads={heads} "
                         "divisible by tp; choose tp dividing num_heads")


def apply_tensor_parallel(model: nn.Module, dims, sequence_parallel: bool = False) -> None:
    """Shard the vocabulary, every attention and every dense MLP of `model` over dims' TP group;
    with `sequence_parallel`, split the tokens between them (sequence_parallel.py)."""
    check_tensor_parallel(model, dims.tp)
    rank, size, group = dims.rank_in(Axis.TP), dims.tp, dims.group(Axis.TP)
    sp = sequence_parallel
    # Under full recompute a block keeps nothing of its forward: nothing to re-gather.
    regather = (lambda: model.recompute != "full") if sp else None
    shard_vocabulary(model, rank, size, group, sp)
    for block in model.layers:
        shard = shard_mla if hasattr(block.attn, "kv_b_proj") else shard_attention
        shard(block.attn, rank, size, group, sp, regather)
        for mlp in _dense_mlps(block):
            # A shared expert runs inside its MoE layer on the rank's own tokens under SP: the
            # same gather / reduce-scatter pair as a dense MLP.
            shard_swiglu(mlp, rank, size, group, sp, regather)
    if sp:
        apply_sequence_parallel(model, group)
