"""Vocab-parallel embedding and LM head, and KV-head replication, against one process (float64).

The losses on a vocabulary split over gloo ranks (model/losses.py VocabShard) equal the whole-
vocabulary functions; the parallelized Transformer under TP (vocabulary rows sharded, and KV heads
replicated when tp > num_kv_heads) gives the reference's loss (aux and z included), router
statistics (aux / z values, expert counts, routes), per-token log-probs, entropies and every
gradient (this rank's slice of it). Tolerance 1e-10: float64, only the order of the sums
(per-shard max / sum-exp then an all-reduce) differs from the single process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.checkpoint.sharded_state import global_slices
from longctx_moe.model import build_model
from longctx_moe.model.attention import doc_layout
from longctx_moe.model.config import BalanceConfig
from longctx_moe.model.losses import VocabShard, chunked_cross_entropy, chunked_token_logprobs
from longctx_moe.model.transformer import LogProbHead
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.parallel.sharding import split_dim
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config

TOL = 1e-10
V, D, T = 24, 8, 19


def _loss_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    h_TD = torch.randn(T, D, generator=gen, dtype=torch.float64)
    w_VD = torch.randn(V, D, generator=gen, dtype=torch.float64)
    labels_T = torch.randint(0, V, (T,), generator=gen)
    labels_T[[0, 5, 6]] = -100  # ignored positions
    weight_T = torch.rand(T, generator=gen, dtype=torch.float64)
    g_T = torch.randn(T, generator=gen, dtype=torch.float64)  # per-token upstream weights (RL)
    return h_TD, w_VD, labels_T, weight_T, g_T


def _ce(h, w, inputs, chunk, temp, shard):
    labels_T, weight_T = inputs[2], inputs[3]
    return chunked_cross_entropy(h, w, labels_T, weight_T, chunk, shard)


def _rl(h, w, inputs, chunk, temp, shard):
    labels_T, g_T = inputs[2], inputs[4]
    logp_T, ent_T = chunked_token_logprobs(h, w, labels_T, chunk, temp, True, shard)
    return (logp_T * g_T).sum() + (ent_T * g_T.flip(0)).sum()


def _grads(fn, h_TD, w_VD, *args):
    h, w = h_TD.clone().requires_grad_(), w_VD.clone().requires_grad_()
    out = fn(h, w, *args)
    out.backward()
    return out.detach(), h.grad, w.grad


def _check_losses(rank, world):
    n = V // world
    shard = VocabShard(dist.group.WORLD, rank * n)
    for seed, (chunk, temp) in enumerate([(4, 1.0), (7, 0.7), (64, 1.3)]):
        inputs = _loss_inputs(seed)
        h_TD, w_VD, labels_T = inputs[:3]
        mine_VD = w_VD[rank * n:(rank + 1) * n]
        for fn in (_ce, _rl):
            want = _grads(fn, h_TD, w_VD, inputs, chunk, temp, None)
            got = _grads(fn, h_TD, mine_VD, inputs, chunk, temp, shard)
            assert abs(got[0] - want[0]).item() < TOL, (fn.__name__, seed)
            assert (got[1] - want[1]).abs().max().item() < TOL, (fn.__name__, seed)
            assert (got[2] - want[2][rank * n:(rank + 1) * n]).abs().max().item() < TOL
        logp_T, ent_T = chunked_token_logprobs(h_TD, w_VD, labels_T, chunk, temp, True)
        got_lp, got_ent = chunked_token_logprobs(h_TD, mine_VD, labels_T, chunk, temp, True, shard)
        assert (got_lp - logp_T).abs().max().item() < TOL
        assert (got_ent - ent_T).abs().max().item() < TOL
    return True


@pytest.mark.slow
def test_vocab_sharded_losses_equal_whole_vocabulary_float64():
    assert run_distributed(_check_losses, world_size=2, timeout=300) == [True] * 2


# ---------------------------------------------------------------- the parallelized Transformer

DOCS = [[5, 9, 1, 13], [7, 3, 11]]  # one packed micro-batch per DP replica


def _model(seed, aux="seq", **overrides):
    """`aux`: balance.aux_loss_type; `overrides`: model.* keys."""
    torch.manual_seed(seed)
    cfg = tiny_config(num_experts=4, top_k=2, first_k_dense=1, shared_expert_hidden_size=16, **overrides)
    balance = BalanceConfig(aux_loss_type=aux, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    model = build_model(cfg, balance=balance).double()
    if cfg.expert_bias:  # a bias that changes the selection (it starts at zero)
        for layer in model.moe_layers():
            layer.router.expert_bias.copy_(0.2 * torch.randn(cfg.num_experts))
    return model


def _replay_routes(batch, model, gen):
    """int [T, L_moe, K] routes to force: distinct random experts for about half of the tokens,
    -1 (route live) for the others."""
    cfg, t = model.cfg, batch.num_tokens
    routes_TLK = torch.rand(t, len(model.moe_layers()), cfg.num_experts, generator=gen)
    routes_TLK = routes_TLK.argsort(-1)[..., :cfg.top_k]
    live_T = torch.rand(t, generator=gen) < 0.5
    return routes_TLK.masked_fill(live_T[:, None, None], -1)


def _rl_loss(out, g_T):
    """A loss weighing every token's log-prob and entropy on its own (as RL does)."""
    return (out.logprobs_T * g_T).sum() + 0.3 * (out.entropy_T * g_T).sum() + out.aux_loss \
        + out.z_loss


def _my_slice(p, want, dims):
    """This rank's piece of the reference tensor `want`, by the one description of a TP shard
    that checkpoints and export read (a declared `tp` split: TP rank r holds the r-th slice) and EP's."""
    dim = split_dim(p, "tp")
    if dim is not None:
        assert want.shape[dim] == p.shape[dim] * dims.tp
        return want.narrow(dim, dims.rank_in("tp") * p.shape[dim], p.shape[dim])
    if p.shape != want.shape:  # an expert weight: this rank's slice of dim 0
        return want.narrow(0, dims.rank_in("ep") * p.shape[0], p.shape[0])
    return want


def _ref_forward(ref, batch, head, replay_TLK):
    if replay_TLK is None:
        return ref(batch, head=head)
    return ref(batch, doc_layout(batch, replay_TLK=replay_TLK), head=head)


def _check_router_stats(runtime, shard, out, want, batch, kw):
    """Aux / z losses and expert counts (shares over CP, summed), routes of the real tokens
    (padding's are garbage that nothing reads) and replay counts of this rank's micro-batch
    equal the reference's."""
    for got, ref in ((out.aux_loss, want.aux_loss), (out.z_loss, want.z_loss)):
        got = runtime.all_reduce(got.detach().clone(), "cp")
        assert abs(got.item() - ref.item()) < TOL, kw
    counts = runtime.all_reduce(out.expert_counts.clone(), "cp")
    assert torch.equal(counts, want.expert_counts), kw
    real_T = batch.real_token_mask()
    routes_TLK = runtime.gather_tokens(shard, out.routes_TLK)
    assert torch.equal(routes_TLK[real_T], want.routes_TLK[real_T]), kw
    replay = torch.tensor([out.replay["known"], out.replay["agree"]])
    ref_replay = [want.replay["known"], want.replay["agree"]]
    assert runtime.all_reduce(replay, "cp").tolist() == ref_replay, kw


def _check_model(rank, world, kw, overrides, head, replay=False, adapt_ref=None, aux="seq"):
    """The parallelized model of ParallelConfig(**kw) on this rank against one process: loss
    (CE or `head`'s RL loss, plus aux and z), router statistics, logits and every gradient.
    `replay`: force random routes for half the tokens; `adapt_ref(ref, dims)`: make the
    reference act as the layout does where that differs from one process (per-chunk capacity);
    `aux`: balance.aux_loss_type."""
    dims = ParallelDims.from_config(ParallelConfig(**kw), world, tiny_config(**overrides),
                                    BalanceConfig(aux_loss_type=aux))
    dims.build_groups(rank)
    gen = torch.Generator().manual_seed(7)
    batches = [packed_batch(d, 64, pad_multiple=2 * dims.cp * dims.tp,
                            generator=gen) for d in DOCS[:dims.dp]]
    g_Ts = [torch.randn(b.num_tokens, generator=gen, dtype=torch.float64) for b in batches]
    ref = _model(3, aux, **overrides)
    if adapt_ref is not None:
        adapt_ref(ref, dims)
    replays = [_replay_routes(b, ref, gen) if replay else None for b in batches]
    ref_outs = [_ref_forward(ref, b, head, r) for b, r in zip(batches, replays, strict=True)]
    if head is None:
        ref_loss = sum(o.ce_sum + o.aux_loss + o.z_loss for o in ref_outs)
    else:
        ref_loss = sum(_rl_loss(o, g) for o, g in zip(ref_outs, g_Ts, strict=True))
    ref_loss.backward()
    runtime = parallelize(_model(3, aux, **overrides), dims)
    model, dp = runtime.model, dims.rank_in("dp")
    shard = runtime.shard(batches[dp], replay_TLK=replays[dp])
    out = runtime.forward(shard, head=head)
    # under CP this rank holds its shard of the tokens (plan order): weigh them alike
    g_T = g_Ts[dp] if shard.cp.size == 1 else shard.plan.shard(g_Ts[dp], shard.cp.rank)
    loss = out.ce_sum + out.aux_loss + out.z_loss if head is None else _rl_loss(out, g_T)
    loss.backward()
    runtime.reduce_gradients()
    total = loss.detach().clone()
    runtime.all_reduce(total, "dp_cp")  # TP peers hold the same loss
    assert abs(total.item() - ref_loss.item()) < TOL, kw
    _check_router_stats(runtime, shard, out, ref_outs[dp], batches[dp], kw)
    if head is not None:
        for got, want in ((out.logprobs_T, ref_outs[dp].logprobs_T),
                          (out.entropy_T, ref_outs[dp].entropy_T)):
            got = runtime.gather_tokens(shard, got.detach())
            assert (got - want).abs().max().item() < TOL, kw
    assert torch.allclose(model.logits(batches[dp]), ref.logits(batches[dp]), atol=TOL, rtol=0)
    ref_params = dict(ref.named_parameters())
    slices = global_slices(model)  # what checkpoints record: whole shape, this piece's offsets
    for name, p in model.named_parameters():
        full, offsets = slices[name]
        piece = ref_params[name].detach()
        assert tuple(full) == tuple(piece.shape), name
        for dim, (off, size) in enumerate(zip(offsets, p.shape, strict=True)):
            piece = piece.narrow(dim, off, size)
        assert torch.equal(piece, p.detach()), name  # the values this rank holds
        want = _my_slice(p, ref_params[name].grad, dims)
        assert (p.grad - want).abs().max().item() < TOL, (kw, name)
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), float("inf"))
    assert abs(runtime.clip_grad_norm(0.0) - float(ref_norm)) < TOL, kw
    return True


CASES = [
    # KV-head replication: 4 query heads, 2 KV heads on 4 TP ranks; untied head; fused CE
    (dict(tp=4), {}, None),
    # vocab-parallel tied embedding, RL head (log-probs and entropies), TP2 x DP2
    (dict(tp=2), dict(tie_embeddings=True), LogProbHead(temperature=0.8, entropy=True)),
    # one KV head replicated on both TP ranks, TP2 x CP2 ring
    (dict(tp=2, cp=2), dict(num_kv_heads=1), None),
]


def _check_cases(rank, world):
    for kw, overrides, head in CASES:
        _check_model(rank, world, kw, overrides, head)
    return True


@pytest.mark.multirank
def test_tensor_parallel_vocab_and_kv_replication_match_single_process_float64():
    assert run_distributed(_check_cases, world_size=4, timeout=600) == [True] * 4


def test_tp_that_splits_a_kv_head_is_refused_with_an_actionable_error():
    cfg = tiny_config(num_heads=6, num_kv_heads=3, head_dim=8)
    with pytest.raises(ValueError, match="one must divide the other"):
        ParallelDims.from_config(ParallelConfig(tp=2), 2, cfg)
    model = build_model(tiny_config(vocab_size=63))
    dims = ParallelDims.from_config(ParallelConfig(tp=2), 2, tiny_config())
    dims.rank = 0  # no process group needed: the check fires before any collective
    with pytest.raises(ValueError, match="pad vocab_size to a multiple of tp"):
        parallelize(model, dims)
