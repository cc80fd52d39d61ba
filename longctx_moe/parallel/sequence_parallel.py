"""Sequence parallelism (Megatron-LM): between the TP regions the residual stream is split along tokens.

With parallel.sequence_parallel the T tokens that a TP group shares are held T/tp per rank outside
attention and the dense MLPs: the norms and residual adds run on a rank's own tokens, so their
activations (kept for the backward) shrink by tp. Each TP region's conjugate pair becomes

    entry: all-gather tokens (backward: reduce-scatter)   instead of copy (backward: all-reduce)
    exit:  reduce-scatter tokens (backward: all-gather)   instead of all-reduce (backward: copy)

The vocab-parallel embedding reduce-scatters its lookup, and the final norm's output is
all-gathered for the LM head. The norms see a rank's own tokens only: their weights' gradients
are partial per TP rank and summed over TP as well (reduce_axis = "world").

An MoE layer runs on the rank's own tokens, as in Megatron-Core's MoE Parallel Folding: the
router routes own rows, the dispatcher sends them over EP and combines them back to own rows,
with no gather over TP (the shared expert is a TP region like a dense MLP, with the SP pair
above). Around it (`add_moe_hooks`):

- its DocLayout is that of own rows (`OwnRowsLayout`: document ids, padding mask and replayed
  routes sliced; document count unchanged), whose `reduce_stats` sums over TP before the
  reduction it had (CP, or dp_cp for the global-batch aux loss). The aux / z losses then come
  out as this rank's share of the value over every token the reduction covers;
- its statistics are completed over TP on exit (`complete_stats`): the aux / z shares summed
  (identity backward: each rank's share depends on its own rows only), the expert counts and
  replay counts summed, the routes all-gathered, so the layer returns what it returns on one
  device for all T tokens;
- the router weight sees own rows only: its gradient is partial per TP rank and summed over
  "world" like the norms'.

TP rank r holds tokens [r T/tp, (r+1) T/tp) of its (CP-local) micro-batch.
Shapes: T tokens of the group, n = T/tp tokens of this rank, D model dim, K top-k, L MoE layers,
E experts.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from longctx_moe.compile import eager_only
from longctx_moe.model.attention import DocLayout
from longctx_moe.model.moe import MoEStats
from longctx_moe.parallel.comm import reduce_scatter_flat, sum_over_group
from longctx_moe.parallel.dims import Axis
from longctx_moe.parallel.grad_reduce import stats_reducer


def _own_rows(x_TD: torch.Tensor, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    t = x_TD.shape[0]
    if t % size:
        raise ValueError(f"sequence parallelism splits this rank's {t} tokens over tp={size}; pad "
                         "every document to a multiple of tp (with CP: of 2*cp*tp) through "
                         "data.pad_multiple, or set parallel.sequence_parallel=false")
    n = t // size
    return x_TD.narrow(0, rank * n, n)


def _all_gather(x_nD: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x_nD) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x_nD.contiguous(), group=group)
    return torch.cat(parts)


def _reduce_scatter(x_TD: torch.Tensor, group) -> torch.Tensor:
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter: the same sum by an all-reduce, then this rank's rows.
        out = x_TD.contiguous().clone()
        dist.all_reduce(out, group=group)
        return _own_rows(out, group).clone()
    out = x_TD.new_empty((x_TD.shape[0] // dist.get_world_size(group), *x_TD.shape[1:]))
    reduce_scatter_flat(out, x_TD.contiguous(), group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    """x_nD of every rank -> x_TD. Backward: reduce-scatter when each rank's gradient is a partial
    sum (a TP region's input), else this rank's rows of the (complete) gradient."""

    @staticmethod
    def forward(ctx, x_nD, group, reduce_grad: bool):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _all_gather(x_nD, group)

    @staticmethod
    def backward(ctx, g_TD):
        if ctx.reduce_grad:
            return _reduce_scatter(g_TD, ctx.group), None, None
        return _own_rows(g_TD, ctx.group).clone(), None, None


class _ScatterTokens(torch.autograd.Function):
    """Partial sums x_TD of every rank (a TP region's output) -> this rank's rows of their sum,
    by reduce-scatter. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x_TD, group):
        ctx.group = group
        return _reduce_scatter(x_TD, group)

    @staticmethod
    def backward(ctx, g_nD):
        return _all_gather(g_nD, ctx.group), None


def gather_tokens(x_nD: torch.Tensor, group, reduce_grad: bool) -> torch.Tensor:
    return _GatherTokens.apply(x_nD, group, reduce_grad)


def scatter_tokens(x_TD: torch.Tensor, group) -> torch.Tensor:
    if x_TD.shape[0] % dist.get_world_size(group):
        _own_rows(x_TD, group)  # raises the one-line error before any collective
    return _ScatterTokens.apply(x_TD, group)


class _Regather:
    """Saved-tensor hooks for one forward of a TP region under SP: whatever the region saves for
    its backward that is (a view of) its all-gathered input is kept as this rank's own rows and
    all-gathered again when the backward first needs it (Megatron-LM's sequence-parallel linears
    do the same), so between forward and backward a rank holds n rows of it instead of T.

    The re-gathered tensor is shared by the region's consumers (q, k and v read one input) and
    dropped after the last of them unpacks it: every saved tensor is unpacked once per backward.
    The values are the forward's, so gradients are bitwise those of keeping the gathered tensor;
    every TP rank re-gathers at the same point of the same backward graph."""

    def __init__(self, x_nD: torch.Tensor, x_TD: torch.Tensor, group):
        self.own, self.group = x_nD, group
        # The storage itself, not its address: storages without memory (meta tensors, empty
        # ones) all sit at address 0. The weak reference also keeps the address from being
        # reused by another storage while this forward runs.
        self.storage = StorageWeakRef(x_TD.untyped_storage())
        self.pending, self.full = 0, None

    def pack(self, t: torch.Tensor):
        if StorageWeakRef(t.untyped_storage()) != self.storage:
            return t
        self.pending += 1
        return self, t.size(), t.stride(), t.storage_offset()

    def unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        _, size, stride, offset = packed
        if self.full is None:
            self.full = _all_gather(self.own, self.group)
        full = self.full
        self.pending -= 1
        if self.pending == 0:
            self.full = None  # the last consumer holds it until its backward is done
        return full.as_strided(size, stride, offset)


def add_sequence_parallel_hooks(module: nn.Module, group, regather=None) -> None:
    """A TP region under SP: tokens all-gathered on entry to the TP-sharded `module` (its input
    gradients are partial: reduce-scatter) and its partial outputs reduce-scattered on exit.
    `regather()` true (checked per forward, e.g. not under full recompute): the gathered tokens
    the region saves are kept as own rows and gathered again in the backward (_Regather)."""
    active = []  # the saved-tensor hooks entered for the forward in progress

    def enter(m, args):
        x_TD = gather_tokens(args[0], group, True)
        if regather is not None and regather() and torch.is_grad_enabled() \
                and not torch.compiler.is_compiling():
            hooks = _Regather(args[0], x_TD, group)
            active.append(torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack))
            active[-1].__enter__()
        return (x_TD, *args[1:])

    def leave(m, args, out):
        if active:
            active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(lambda m, args, out: scatter_tokens(out, group))
    module.register_forward_hook(leave, always_call=True)  # also when the forward raises


def own_rows_layout(layout: DocLayout, group) -> DocLayout:
    """The layout of this rank's own rows for an MoE layer: per-token fields sliced, document ids
    and count kept global to the micro-batch, statistics summed over TP and then over what
    `layout` summed them. Its attention fields (cu_attn_S, cu_attn_host_S, max_attn) still
    describe all T tokens: only the MoE layer reads it."""
    def own(t):
        return None if t is None else _own_rows(t, group)

    tp_sum, then = stats_reducer(group), layout.reduce_stats
    reduce = tp_sum if then is None else (lambda t: then(tp_sum(t)))
    return dataclasses.replace(
        layout, position_ids_T=own(layout.position_ids_T), doc_id_T=own(layout.doc_id_T),
        real_mask_T=own(layout.real_mask_T), replay_TLK=own(layout.replay_TLK),
        reduce_stats=reduce, attend=None, rope={})


class OwnRowsLayout:
    """own_rows_layout of the layout the model passes, built once per micro-batch: the first MoE
    layer builds it and the others (and a recomputed block) find it here. Holds its source by
    weak reference, so a finished micro-batch's layout is not kept alive."""

    def __init__(self, group):
        self.group = group
        self._source, self._own = None, None

    def __call__(self, layout: DocLayout) -> DocLayout:
        if self._source is None or self._source() is not layout:
            self._own = own_rows_layout(layout, self.group)
            self._source = weakref.ref(layout)
        return self._own


@eager_only  # collectives
def complete_stats(stats: MoEStats, group, replayed: bool = True) -> MoEStats:
    """The statistics of all T tokens of the TP group from this rank's own-rows ones: the aux
    and z shares summed (differentiable), expert and replay counts summed, routes gathered.
    Nothing is read back from the device: the replay counts are device scalars summed there,
    and only where routes were replayed (`replayed`, the same on every TP rank: they run one
    micro-batch; without replay every rank's counts are host 0s)."""
    losses = sum_over_group(torch.stack([stats.aux_loss, stats.z_loss]), group)  # shares of own rows
    counts_E = stats.counts_E.clone()
    dist.all_reduce(counts_E, group=group)
    known, agree = stats.replay_known, stats.replay_agree
    if replayed:
        replay = torch.stack([known, agree])
        dist.all_reduce(replay, group=group)
        known, agree = replay[0], replay[1]
    return dataclasses.replace(stats, aux_loss=losses[0], z_loss=losses[1], counts_E=counts_E,
                               topk_idx_TK=_all_gather(stats.topk_idx_TK, group),
                               replay_known=known, replay_agree=agree)


def add_moe_hooks(moe: nn.Module, group, own_layout: OwnRowsLayout) -> None:
    """Run `moe` (forward(x, layout, replay_TK) -> (y, MoEStats)) on this rank's own rows: the
    layout and the replayed routes (given for all T tokens) become those of own rows on entry,
    and the statistics are completed over TP on exit; x and y stay own rows."""

    @eager_only
    def enter(m, args):
        x_nD, layout, *rest = args
        replay_TK = rest[0] if rest else None
        replay_nK = None if replay_TK is None else _own_rows(replay_TK, group)
        return x_nD, own_layout(layout), replay_nK

    def leave(m, args, out):
        replayed = len(args) > 2 and args[2] is not None  # the own-rows args that enter() gave
        return out[0], complete_stats(out[1], group, replayed)

    moe.register_forward_pre_hook(enter)
    moe.register_forward_hook(leave)


def apply_sequence_parallel(model: nn.Module, group) -> None:
    """The token-split pieces around the TP regions (tensor_parallel.py adds the regions' own
    gather / reduce-scatter hooks, the shared experts' included): MoE layers on own rows, the
    final norm, and the gradients that own rows leave partial (norms, routers)."""
    own_layout = OwnRowsLayout(group)  # one per model: the layers of a micro-batch share it
    for block in model.layers:
        if block.is_moe:
            add_moe_hooks(block.ffn, group, own_layout)
            for p in block.ffn.router.parameters():  # own rows only: partial per TP rank
                p.reduce_axis = Axis.WORLD
    model.norm.register_forward_hook(lambda m, args, out: gather_tokens(out, group, False))
    for norm in [b.attn_norm for b in model.layers] + [b.ffn_norm for b in model.layers] + [model.norm]:
        norm.weight.reduce_axis = Axis.WORLD  # own tokens only: partial per TP rank
