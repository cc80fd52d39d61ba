"""Sequence parallelism (parallel.sequence_parallel) against one process, float64.

Under SP the residual stream between the TP regions is split along tokens (norms on 1/tp of the
tokens, all-gather / reduce-scatter around attention, the dense MLPs and the shared experts) and
each MoE layer routes only its TP rank's own tokens. The loss (CE or an RL loss, aux and z), the
per-token log-probs and entropies, the expert counts, the routes and every gradient equal the
unsharded model's within 1e-10 (float64; only the order of the sums differs), as in
test_vocab_parallel; with switch and seq aux losses, expert bias, router replay, a capacity
factor (per TP rank's own tokens, which the reference applies per chunk) and the overlapped EP
dispatcher. Through the Trainer, the global-batch aux loss under SP tracks one process.
"""

from __future__ import annotations

import pytest
import torch

from data_packing.batch import pad_multiple
from longctx_moe.model import build_model
from longctx_moe.model.transformer import LogProbHead
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.dispatch import AllToAllDispatcher, route
from longctx_moe.parallel.parallelize import parallelize
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config
from tests.parallel.test_train_parallel import _check as check_training
from tests.parallel.test_vocab_parallel import _check_model

CAPACITY = dict(capacity_factor=0.5, drop_policy="position")
CASES = [
    # TP2 x DP2: a dense first layer and an MoE layer with a shared expert, fused CE
    (dict(tp=2, sequence_parallel=True), {}, None),
    # TP2 x CP2 (ring): each CP rank's tokens split again over TP; RL head with entropies
    (dict(tp=2, cp=2, sequence_parallel=True), {}, LogProbHead(temperature=0.9, entropy=True)),
    # TP4: replicated KV heads and a tied vocab-parallel embedding under SP
    (dict(tp=4, sequence_parallel=True), dict(tie_embeddings=True), None),
]
# (ParallelConfig, model overrides, head, with per-chunk capacity, balance.aux_loss_type): router
# replay in both
ROUTER_CASES = [
    # TP2 x DP2: switch aux loss, expert bias, capacity on each TP rank's own tokens
    (dict(tp=2, sequence_parallel=True, **CAPACITY), dict(expert_bias=True), None, True, "switch"),
    # TP2 x CP2 / EP2: seq aux loss, the shared expert's SP collectives inside the overlapped
    # all-to-all, RL head
    (dict(tp=2, cp=2, ep=2, sequence_parallel=True, moe_overlap=True),
     dict(expert_bias=True), LogProbHead(entropy=True), False, "seq"),
]


class _PerChunk:
    """The reference's dispatcher where the layout's TP ranks route their own rows with a
    capacity: capacity on one rank, applied to each of the tp contiguous chunks of the tokens."""

    def __init__(self, num_experts: int, parts: int):
        self.inner = AllToAllDispatcher(num_experts, **CAPACITY)
        self.num_experts, self.parts, self.dropped = num_experts, parts, 0

    def __call__(self, x_TD, topk_idx_TK, topk_weight_TK, experts):
        chunks = zip(x_TD.chunk(self.parts), topk_idx_TK.chunk(self.parts),
                     topk_weight_TK.chunk(self.parts), strict=True)
        out = []
        for x_nD, idx_nK, w_nK in chunks:
            kept = route(idx_nK, w_nK, self.num_experts, **CAPACITY).token_N.numel()
            self.dropped += idx_nK.numel() - kept
            out.append(self.inner(x_nD, idx_nK, w_nK, experts))
        return torch.cat(out)


def _check_router_case(rank, world, kw, overrides, head, capacity, aux):
    dispatchers = []

    def per_chunk_capacity(ref, dims):
        for layer in ref.moe_layers():
            layer.dispatcher = _PerChunk(ref.cfg.num_experts, dims.tp)
            dispatchers.append(layer.dispatcher)

    _check_model(rank, world, kw, overrides, head, replay=True,
                 adapt_ref=per_chunk_capacity if capacity else None, aux=aux)
    assert not capacity or sum(d.dropped for d in dispatchers) > 0  # the capacity bites


def _check_router_rows(rank, world):
    """Each MoE layer's router sees this rank's n = T/tp rows, and its dispatcher gets no TP
    split (TP4 with EP4: one TP group spans the world)."""
    cfg = ParallelConfig(tp=4, ep=4, sequence_parallel=True)
    dims = ParallelDims.from_config(cfg, world, tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(build_model(tiny_config(first_k_dense=1)).double(), dims, cfg)
    rows = []
    for layer in runtime.model.moe_layers():
        assert layer.dispatcher.tp_group is None
        layer.router.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    batch = packed_batch([5, 9, 1, 13], 64, pad_multiple=4)
    runtime.forward(runtime.shard(batch))
    assert rows == [batch.num_tokens // 4] * len(runtime.model.moe_layers()), rows


def _check_cases(rank, world):
    for kw, overrides, head in CASES:
        _check_model(rank, world, kw, overrides, head)
    for case in ROUTER_CASES:
        _check_router_case(rank, world, *case)
    _check_router_rows(rank, world)
    return True


@pytest.mark.multirank
def test_sequence_parallel_matches_single_process_float64():
    assert run_distributed(_check_cases, world_size=4, timeout=600) == [True] * 4


def _check_uneven(rank, world):
    dims = ParallelDims.from_config(ParallelConfig(tp=2, sequence_parallel=True), world,
                                    tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(build_model(tiny_config()).double(), dims)
    batch = packed_batch([3, 4], 64)  # 7 tokens: not divisible by tp
    with pytest.raises(ValueError, match="pad every document to a multiple of tp"):
        runtime.forward(runtime.shard(batch))
    return True


@pytest.mark.slow
def test_tokens_not_divisible_by_tp_are_refused_with_an_actionable_error():
    assert run_distributed(_check_uneven, world_size=2, timeout=300) == [True] * 2
    dims = ParallelDims.from_config(ParallelConfig(sequence_parallel=True), 1, tiny_config())
    dims.build_groups(0)
    with pytest.raises(ValueError, match="set tp > 1 or sequence_parallel=false"):
        parallelize(build_model(tiny_config()), dims)


def test_padding_lets_every_cp_rank_split_its_tokens_over_tp():
    # a document split over CP leaves slot / CP tokens on each CP rank; SP splits those TP ways
    for cp, tp in [(1, 2), (2, 2), (2, 4), (4, 2), (4, 4), (3, 2)]:
        slot = pad_multiple(cp, tp, sequence_parallel=True)
        assert slot % (2 * cp if cp > 1 else 1) == 0 and (slot // cp) % tp == 0, (cp, tp)
    assert pad_multiple(2, 4) == 4  # without SP the padding is unchanged


@pytest.mark.slow
def test_global_batch_aux_loss_under_sp_tracks_single_process_through_the_trainer_float64():
    # TP2 x DP2: the switch statistics summed over TP (each rank's own tokens) and dp_cp
    sets = ["parallel.tp=2", "parallel.sequence_parallel=true",
            "parallel.aux_loss_scope=global_batch", "balance.aux_loss_type=switch"]
    check_training(4, [sets], dps=[2], pad=8)
