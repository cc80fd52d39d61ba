"""Sequence parallelism (parallel.sequence_parallel) against one process, float64.

Under SP the residual stream between the TP regions is split along tokens (norms on 1/tp of the
tokens, all-gather / reduce-scatter around attention and the dense MLPs, MoE on the gathered
tokens). The loss, the per-token log-probs and entropies and every gradient equal the unsharded
model's within 1e-10 (float64; only the order of the sums differs), as in test_vocab_parallel.
"""

from __future__ import annotations

import pytest

from data_packing.batch import pad_multiple
from longctx_moe.model import build_model
from longctx_moe.model.transformer import LogProbHead
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config
from tests.parallel.test_vocab_parallel import _check_model

CASES = [
    # TP2 x DP2: a dense first layer and an MoE layer with a shared expert, fused CE
    (dict(tp=2, sequence_parallel=True), {}, None),
    # TP2 x CP2 (ring): each CP rank's tokens split again over TP; RL head with entropies
    (dict(tp=2, cp=2, sequence_parallel=True), {}, LogProbHead(temperature=0.9, entropy=True)),
    # TP4: replicated KV heads and a tied vocab-parallel embedding under SP
    (dict(tp=4, sequence_parallel=True), dict(tie_embeddings=True), None),
]


def _check_cases(rank, world):
    for kw, overrides, head in CASES:
        _check_model(rank, world, kw, overrides, head)
    return True


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
