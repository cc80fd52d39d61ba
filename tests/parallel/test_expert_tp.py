"""Expert tensor parallelism (parallel.etp > 1) through the real Trainer, float64.

Two optimizer steps on the parallelized model against the single-process run: the loss, the
gradient norm and every gradient (after reduction and clipping, assembled into whole tensors from
each rank's piece at the global slice `sharded_state.global_slices` gives it) at each step, then
the parameters, agree within 1e-10 (only the order of sums differs: the hidden units' partial
outputs are summed over ETP). Shared expert, expert bias, aux and z losses and clipping are on
(tests/parallel/test_train_parallel.SETS). Layouts:

    world 4: TP2 / ETP2 EP2 (the ETP group is the TP group), overlapped all-to-all, selective
             recompute; DP4 / ETP2 EP2 with the all-gather dispatcher and a capacity factor;
             CP2 DP2 / ETP2 EDP2 (TP = 1: ETP peers hold different tokens), full recompute,
             the distributed optimizer (AdamW state of ETP-split experts in EDP slabs)
    world 8: TP2 CP2 DP2 / ETP2 EP2 EDP2 with sequence parallelism, and / ETP2 EP4 overlapped

The first world-4 layout also checkpoints: the step saved under ETP2 loads on one rank (ETP1)
with the same parameters and AdamW state, and longctx_moe.hf.weights gathers the same expert tensors as
the single-process export.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from data_packing.batch import pad_multiple
from longctx_moe.build import resolve_ops
from longctx_moe.checkpoint.sharded_state import global_slices
from longctx_moe.checkpoint.trainer_state import load_trainer, save_trainer
from longctx_moe.config import load_config
from longctx_moe.hf.weights import _layer_experts
from longctx_moe.model import build_model
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import Trainer
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch
from tests.parallel.test_train_folded_e2e import train_on_four_forked_ranks
from tests.parallel.test_train_parallel import DOCS, SETS

STEPS = 2
TOL = 1e-10
WORLD4 = [["parallel.tp=2", "parallel.etp=2", "parallel.ep=2", "parallel.moe_overlap=true",
           "train.recompute=selective", "balance.aux_loss_type=seq"],
          ["parallel.etp=2", "parallel.ep=2", "parallel.dispatcher=allgather",
           "parallel.capacity_factor=0.75", "parallel.drop_policy=position",
           "balance.aux_loss_type=switch"],
          ["parallel.cp=2", "parallel.etp=2", "train.recompute=full", "balance.aux_loss_type=seq",
           "parallel.distributed_optimizer=true"]]
WORLD8 = [["parallel.tp=2", "parallel.cp=2", "parallel.etp=2", "parallel.ep=2",
           "parallel.sequence_parallel=true", "balance.aux_loss_type=seq"],
          ["parallel.tp=2", "parallel.cp=2", "parallel.etp=2", "parallel.ep=4",
           "parallel.moe_overlap=true", "balance.aux_loss_type=switch"]]


def _steps(sets):
    """STEPS lists of 4 micro-batches, padded as the trainer's loader pads for the layout."""
    p = load_config(None, SETS + sets).parallel
    gen = torch.Generator().manual_seed(11)
    pad = pad_multiple(p.cp, p.tp, p.sequence_parallel)
    return [[packed_batch(d, 64, pad_multiple=pad, generator=gen) for d in DOCS]
            for _ in range(STEPS)]


def _trainer(sets, dims) -> Trainer:
    cfg = load_config(None, SETS + [f"train.steps={STEPS}"] + sets)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, resolve_ops(cfg, torch.device("cpu")), balance=cfg.balance).to(torch.float64)
    parallel = cfg.parallel
    if dims is None:  # the single-process reference: the same settings on one rank
        parallel = dataclasses.replace(parallel, tp=1, cp=1, ep=1, etp=1, cp_backend="ring",
                                       sequence_parallel=False, moe_overlap=False)
    return Trainer(cfg, parallelize(model, dims, parallel))


def _capture_grads(trainer: Trainer, into: list) -> None:
    """Record every parameter's gradient as the optimizer sees it (reduced, clipped)."""
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        if hasattr(trainer.optimizer, "gather_grads"):  # distributed optimizer: slabs hold them
            full = trainer.optimizer.gather_grads()
            into.append({n: full[id(p)].clone() for n, p in trainer.model.named_parameters()})
        else:
            into.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step


def _run(sets, dims, steps):
    """(per step: loss, grad norm, {name: grad}), final state dict, each piece with its slice."""
    trainer = _trainer(sets, dims)
    grads: list = []
    _capture_grads(trainer, grads)
    results = [trainer.train_step(mbs) for mbs in steps]
    slices = global_slices(trainer.model) if dims is not None else None
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    steps_out = [(r.loss, r.grad_norm, g) for r, g in zip(results, grads, strict=True)]
    return trainer, steps_out, state, slices


def _assemble(pieces_by_rank: list[tuple[dict, dict]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's (tensors, slices); replicas must agree exactly."""
    out: dict[str, torch.Tensor] = {}
    for tensors, slices in pieces_by_rank:
        for name, t in tensors.items():
            full, offsets = slices[name]
            whole = out.setdefault(name, torch.full(full, float("nan"), dtype=t.dtype))
            box = whole
            for d, (o, n) in enumerate(zip(offsets, t.shape, strict=True)):
                box = box.narrow(d, o, n)
            if not box.isnan().all():
                assert torch.equal(box, t), f"replicas of {name} differ"
            box.copy_(t)
    for name, whole in out.items():
        assert not whole.isnan().any(), f"{name}: no rank holds part of it"
    return out


def _expert_export(model, dims) -> list[tuple[str, torch.Tensor]]:
    """longctx_moe.hf.weights's expert tensors (HF names), gathered over ep and etp. The whole export
    refuses this model (Qwen3-MoE has no shared expert): the expert units are what ETP changes."""
    return [unit for layer in range(model.cfg.first_k_dense, model.cfg.num_layers)
            for units in _layer_experts(model, layer, dims, torch.float64) for unit in units]


def _rank(rank, world, layouts, ckpt_dir):
    out = []
    for i, sets in enumerate(layouts):
        cfg = load_config(None, SETS + sets)
        dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
        dims.build_groups(rank)
        r, n = dims.rank_in("dp"), dims.size("dp")
        trainer, steps, state, slices = _run(sets, dims, [mbs[r::n] for mbs in _steps(sets)])
        extra = {}
        if i == 0 and ckpt_dir is not None:
            extra["ckpt"] = str(save_trainer(trainer, None, Path(ckpt_dir), rank, world, 0))
            extra["export"] = _expert_export(trainer.model, dims)
        out.append(([(loss, norm, (g, slices)) for loss, norm, g in steps], (state, slices),
                    extra))
    return out


def _max_err(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _check(world, layouts, ckpt_dir=None) -> list[float]:
    got = run_distributed(_rank, world, args=(layouts, ckpt_dir), timeout=600)
    errors = []
    for i, sets in enumerate(layouts):
        ref_trainer, ref_steps, ref_state, _ = _run(sets, None, _steps(sets))
        worst = 0.0
        for step, (ref_loss, ref_norm, ref_grads) in enumerate(ref_steps):
            for rank_out in got:
                loss, norm, _ = rank_out[i][0][step]
                assert abs(loss - ref_loss) <= TOL, (sets, step, loss, ref_loss)
                assert abs(norm - ref_norm) <= TOL * max(1.0, ref_norm), (sets, step, norm)
            grads = _assemble([rank_out[i][0][step][2] for rank_out in got])
            worst = max(worst, _max_err(grads, ref_grads))
        assert len({ref_steps[0][0], ref_steps[-1][0]}) == 2  # the run trains: the loss moves
        state = _assemble([rank_out[i][1] for rank_out in got])
        worst = max(worst, _max_err(state, ref_state))
        assert worst <= TOL, (sets, worst)
        errors.append(worst)
        if i == 0 and ckpt_dir is not None:
            _check_checkpoint_and_export(got, sets, ref_trainer)
    return errors


def _check_checkpoint_and_export(got, sets, ref_trainer) -> None:
    """The ETP2 checkpoint on one rank (ETP1) holds the parallel run's state; its expert export
    equals the single-process one."""
    ckpt = Path(got[0][0][2]["ckpt"])
    meta = json.loads((ckpt / "meta.json").read_text())
    entry = meta["tensors"]["model.layers.1.ffn.experts.w_gate_up"]
    assert len(entry["pieces"]) == 4  # 2 EP x 2 ETP blocks, each written once
    one = _trainer(sets, None)  # one rank: etp = tp = ep = 1
    with torch.no_grad():
        for p in one.model.parameters():
            p.add_(1.0)  # loading must overwrite every parameter
    load_trainer(one, None, ckpt, 0, 1)
    parallel_state = _assemble([rank_out[0][1] for rank_out in got])
    assert _max_err(one.model.state_dict(), parallel_state) == 0.0
    names = {id(p): n for n, p in one.model.named_parameters()}
    ref_names = {id(p): n for n, p in ref_trainer.model.named_parameters()}
    ref_opt = {ref_names[id(p)]: s for p, s in ref_trainer.optimizer.state.items()}
    for p, st in one.optimizer.state.items():
        for field in ("exp_avg", "exp_avg_sq"):
            assert (st[field] - ref_opt[names[id(p)]][field]).abs().max() <= TOL
    ref_export = _expert_export(ref_trainer.model, ref_trainer.dims)
    mine = got[0][0][2]["export"]
    assert [n for n, _ in mine] == [n for n, _ in ref_export]
    assert max(float((a - b).abs().max()) for (_, a), (_, b) in zip(mine, ref_export,
                                                                    strict=True)) <= TOL


@pytest.mark.slow
def test_world4_etp_tracks_single_process_float64_and_checkpoint_reshards(tmp_path):
    errors = _check(4, WORLD4, tmp_path / "ckpt")
    print("max abs error per layout:", errors)


@pytest.mark.slow
def test_world8_tp2_cp2_dp2_etp2_tracks_single_process_float64():
    errors = _check(8, WORLD8)
    print("max abs error per layout:", errors)


@pytest.mark.slow
def test_default_config_trains_tp2_etp2_ep2_on_four_ranks(tmp_path, corpus):
    train_on_four_forked_ranks(tmp_path, corpus, ["parallel.tp=2", "parallel.etp=2", "parallel.ep=2"])
