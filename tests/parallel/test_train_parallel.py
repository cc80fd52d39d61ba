"""Six optimizer steps of the real Trainer on a parallelized model track the single-process run.

Float64, same seed and data order, seq or switch aux loss, z-loss and expert bias on. Each step
has 4 global micro-batches; DP replica r of R takes micro-batches i with i % R == r (its CP / TP
peers hold the same ones); the reference trains on all 4. With the global-batch aux loss the
reference's micro-batch j concatenates the replicas' j-th micro-batches (one balance
statistic over them, as the parallel run computes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx_moe.build import resolve_ops
from longctx_moe.config import load_config
from longctx_moe.model import build_model
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import Trainer
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch
from tests.parallel._moe_ref import concat_batches

# Six steps: the two warmup steps, then four at the full rate with clipping active and AdamW's
# moments read back, each step's loss and norm compared. Expert-bias updates act on the loss only
# once they flip a top-k choice, which a few steps of 0.01 may not do, so the biases are compared
# after every step too (a rank that counted differently is off by 0.01 or 0.02).
STEPS = 6
# In float64 only the summation order differs (every step's loss
# and norm agreed within 1e-11 when measured); only a top-k tie flipped by rounding could come near.
TOL = 1e-6
DOCS = [[9, 3, 1], [2, 7], [13], [5, 6, 2]]  # a length-1 document, one spanning every CP rank
SETS = ["train.param_dtype=fp64", "train.autocast_dtype=none", f"train.steps={STEPS}",
        "optim.warmup_steps=2", "optim.lr=1e-2", "optim.grad_clip=0.5", "model.vocab_size=64",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=8", "model.num_experts=4", "model.top_k=2", "model.expert_hidden_size=16",
        "model.first_k_dense=1", "model.dense_hidden_size=32", "model.shared_expert_hidden_size=16",
        "balance.aux_loss_coeff=0.1", "balance.z_loss_coeff=0.01", "model.expert_bias=true",
        "balance.expert_bias_update_rate=0.01", "execution.loss_chunk_tokens=16"]
# world 4: CP4 as hierarchical 2x2 / EP2 EDP2, and CP2 DP2 / EP4 with
# Megatron's global-batch aux loss; world 8: TP2 CP2 DP2 / EP4 EDP2.
# Recompute re-runs the CP executors and the expert all-to-alls in the backward: full and
# selective recompute ride along here (the single-process reference recomputes too; the model
# tests show recompute leaves gradients unchanged).
WORLD4 = [["parallel.cp=4", "parallel.ep=2", "parallel.cp_backend=hierarchical",
           "parallel.hierarchical_sizes=[2, 2]", "balance.aux_loss_type=seq", "train.recompute=full"],
          ["parallel.cp=2", "parallel.ep=4", "parallel.aux_loss_scope=global_batch",
           "balance.aux_loss_type=switch", "train.recompute=selective"]]
# world 2, pure DP and DP x EP: the capacity factor, the drop policy and the global-batch aux
# loss act as on one rank (capacity is per source rank and micro-batch, which is what the
# reference's sequential micro-batches see).
WORLD2 = [["parallel.capacity_factor=0.5", "parallel.drop_policy=position",
           "balance.aux_loss_type=switch"],
          ["parallel.ep=2", "parallel.capacity_factor=0.75", "balance.aux_loss_type=seq"],
          ["parallel.aux_loss_scope=global_batch", "balance.aux_loss_type=switch"]]
WORLD8 = [["parallel.tp=2", "parallel.cp=2", "parallel.ep=4", "balance.aux_loss_type=seq"],
          ["parallel.tp=2", "parallel.cp=2", "parallel.ep=4", "balance.aux_loss_type=switch"]]


def _steps(pad: int):
    """STEPS lists of 4 micro-batches; every slot padded to `pad` (2 * CP * TP of the layout)."""
    gen = torch.Generator().manual_seed(11)
    return [[packed_batch(d, 64, pad_multiple=pad, generator=gen) for d in DOCS]
            for _ in range(STEPS)]


def _train(sets, dims, steps):
    cfg = load_config(None, SETS + sets)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, resolve_ops(cfg, torch.device("cpu")), balance=cfg.balance).to(torch.float64)
    parallel = cfg.parallel
    if dims is None:  # the single-process reference: the same settings on one rank
        parallel = dataclasses.replace(parallel, tp=1, cp=1, ep=1, cp_backend="ring",
                                       sequence_parallel=False,
                                       hierarchical_sizes=None)
    trainer = Trainer(cfg, parallelize(model, dims, parallel))
    history, biases = [], []
    for mbs in steps:
        r = trainer.train_step(mbs)
        history.append((r.loss, r.grad_norm))
        biases.append(torch.stack([m.router.expert_bias.clone() for m in model.moe_layers()]))
    return history, biases


def _reference(sets, pad, dp):
    steps = _steps(pad)
    if "parallel.aux_loss_scope=global_batch" in sets:
        # replica r's j-th micro-batch is mbs[r::dp][j] = mbs[j * dp + r]
        steps = [[concat_batches(mbs[j * dp:(j + 1) * dp]) for j in range(len(mbs) // dp)]
                 for mbs in steps]
    return _train(sets, None, steps)


def _rank(rank, world, layouts, pad):
    out = []
    for sets in layouts:
        cfg = load_config(None, SETS + sets)
        dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
        dims.build_groups(rank)
        r, n = dims.rank_in("dp"), dims.size("dp")
        out.append(_train(sets, dims, [mbs[r::n] for mbs in _steps(pad)]))
    return out


def _check(world, layouts, dps, pad):
    got = run_distributed(_rank, world, args=(layouts, pad), timeout=600)
    for i, sets in enumerate(layouts):
        assert_tracks(sets, [r[i] for r in got], _reference(sets, pad, dps[i]))


def assert_tracks(sets, rank_runs, ref):
    """Every rank's (losses and norms, expert biases) of one layout, step by step, against the
    reference's."""
    ref_history, ref_biases = ref
    assert len({ref_history[0][0], ref_history[-1][0]}) == 2  # the run trains: the loss moves
    # The bias moves (it may swing back to 0 later: hence a comparison after every step).
    assert any(b.abs().sum() > 0 for b in ref_biases)
    for history, biases in rank_runs:
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, ref_history,
                                                                        strict=True)):
            assert abs(loss - ref_loss) <= TOL, (sets, step, loss, ref_loss)
            assert abs(norm - ref_norm) <= TOL * max(1.0, ref_norm), (sets, step)
        # sums of +-0.01 in the same order when the counts agree: equal
        for step, (bias, ref_bias) in enumerate(zip(biases, ref_biases, strict=True)):
            assert torch.equal(bias, ref_bias), (sets, step, bias, ref_bias)


@pytest.mark.slow
def test_six_steps_world2_dp_capacity_and_global_aux_track_single_process_float64():
    _check(2, WORLD2, dps=[2, 2, 2], pad=1)


@pytest.mark.slow
def test_six_steps_world4_track_single_process_float64():
    _check(4, WORLD4, dps=[1, 2], pad=8)


@pytest.mark.slow
def test_six_steps_world8_tp2_cp2_dp2_ep4_track_single_process_float64():
    _check(8, WORLD8, dps=[2, 2], pad=8)
