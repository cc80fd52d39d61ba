"""The longctx_moe engine driven by verl's own TrainingWorker (verl 0.9.1 from the registry).

TrainingWorker is the lowest verl layer that owns an engine; it runs here without Ray (its
methods are called directly, as Ray would on each worker) on 1 and 2 gloo ranks. Each rank gets
the contiguous chunk verl's dispatch hands its DP rank. One pass does what verl's PPO trainer does
per step: old log-probs and entropies (infer_batch), one update with verl's ppo_loss
(train_mini_batch), the weight export the rollout refit streams (get_per_tensor_param), log-probs
again on the updated weights, and a checkpoint saved, reset and loaded back.

References: float32, transformers' forward scored by verl's logprobs_from_logits /
entropy_from_logits and verl's ppo_loss, an AdamW step of transformers' parameters; float64, our
single-device model's forward scored the same way (transformers computes RMSNorm and softmaxes in
float32 even for a float64 model, ~1e-7 relative: tests/model/test_hf_interop.py).
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from functools import partial

import pytest
import torch

from tests.launcher import run_distributed
from tests.rl_hooks import verl_cases as vc

pytest.importorskip("verl")

# float32: log-probs of size ~4 and gradients summed over ~40 tokens in a different order than
# transformers (packing, per-expert GEMMs): ~1e-6 observed, 1e-5 allowed. float64 (same model
# code on both sides, different packing / reduction order): ~2e-15 observed, 1e-10 allowed.
TOL = {"float32": 1e-5, "float64": 1e-10}


def _engine_pass(rank: int, world: int, folder: str, dtype: str, layout: list[str], budget: int,
                 offload: bool = False) -> dict:
    from omegaconf import OmegaConf
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.metric import reduce_metrics
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    omega_conf_to_dataclass(OmegaConf.merge(OmegaConf.load(vc.ROOT / "configs/verl_engine.yaml").model_config,
                                            {"path": folder}))
    assert EngineRegistry.get_engine_cls("language_model", "longctx_moe").__module__ == \
        "rl_hooks.plugins.verl.engine"
    config = vc.worker_config(folder, dtype, layout, budget)
    if offload:
        config = _offloading(config)
    worker = TrainingWorker(config)
    worker.reset()
    # verl dispatches by the engine's DP rank: CP / TP ranks of a replica get the same chunk
    dp_rank, dp = worker.engine.get_data_parallel_rank(), worker.engine.get_data_parallel_size()
    worker.set_loss_fn(partial(ppo_loss, config=vc.actor_config()))
    data = vc.padded_batch()

    def infer():
        td = vc.share(data, dp_rank, dp)
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=1.0)
        out = worker.infer_batch(td)
        if out is None:  # not a rank with outputs (a CP / TP rank other than the first)
            return None, None
        return [x.clone() for x in tu.get(out, "log_probs").unbind()], \
            [x.clone() for x in tu.get(out, "entropy").unbind()]

    lp, ent = infer()
    td = vc.share(data, dp_rank, dp)
    b = data.batch_size[0]
    tu.assign_non_tensor(td, calculate_entropy=True, global_batch_size=b, mini_batch_size=b, epochs=1,
                         seed=0, dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
    out = worker.train_mini_batch(td)
    # what the train mode's exit sent to the host: every part, every byte (offload cases)
    away = worker.engine.policy.offloaded
    left = worker.engine.policy.export_gate.residency.device_bytes()
    metrics = None if out is None else tu.get(out, "metrics")
    loss = None if out is None else list(metrics["loss"])
    reduced = None if out is None else {k: float(v) for k, v in reduce_metrics(dict(metrics)).items()}
    export = {n: t.clone() for n, t in worker.engine.get_per_tensor_param()[0]}
    lp2, _ = infer()
    # Our checkpoint under verl's folder; reset() starts again from the HF weights, the load
    # brings the updated ones back.
    ckpt = f"{folder}/../ckpt/global_step_1/actor"
    worker.save_checkpoint(ckpt, global_step=1)
    worker.reset()
    fresh, _ = infer()
    worker.load_checkpoint(ckpt)
    loaded, _ = infer()
    if lp is not None:
        assert all(torch.equal(a, b) for a, b in zip(loaded, lp2, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(fresh, lp2, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(fresh, lp, strict=True))
    return {"lp": lp, "ent": ent, "loss": loss, "metrics": reduced, "lp2": lp2, "dp_rank": dp_rank,
            "export": export if rank == 0 else None, "away": away, "left": left}


def _engine_passes(rank: int, world: int, passes: list[tuple]) -> list:
    """`_engine_pass` for each of `passes` (its arguments after rank and world), one after another
    in this rank's process: each rank imports verl and joins the process group once for all the
    passes of its world size (that start-up was about half of a pass's time). A pass that raises
    gives its traceback in its place, failing its own test only."""
    # The plugin arrives through the model config's external_lib, nothing else.
    assert "rl_hooks.plugins.verl" not in sys.modules
    out = []
    for folder, dtype, layout, budget, offload in passes:
        try:
            with _forced_moves() if offload else contextlib.nullcontext():
                out.append(_engine_pass(rank, world, folder, dtype, layout, budget, offload))
        except Exception:  # noqa: BLE001 - reported by the test of this pass
            out.append(f"rank {rank}: {traceback.format_exc()}")
    return out


@contextlib.contextmanager
def _forced_moves():
    """The engine's residency made to copy and free its storages on this CPU (rl_hooks/offload.py:
    on a CPU run it moves nothing otherwise), so that every mode switch runs the GPU's path; the
    passes after this one build theirs as before."""
    from rl_hooks.offload import Residency

    init = Residency.__init__
    Residency.__init__ = lambda self, trainer, device, moves=None: init(self, trainer, device, True)
    try:
        yield
    finally:
        Residency.__init__ = init


def _offloading(config):
    """verl's config with param_offload and optimizer_offload true."""
    import dataclasses

    engine = dataclasses.replace(config.engine_config, param_offload=True, optimizer_offload=True)
    return dataclasses.replace(config, engine_config=engine)


def _our_logits(folder, dtype):
    from data_packing.batch import PackedBatch, position_ids_from_cu
    from longctx_moe.hf.load import load_hf_model

    model = load_hf_model(folder, vc.SETS).to(vc.DTYPES[dtype][1])

    def logits_of(ids):
        cu = torch.tensor([0, ids.numel()], dtype=torch.int32)
        batch = PackedBatch(tokens=ids, labels=torch.roll(ids, -1), cu_seqlens=cu, cu_seqlens_padded=cu,
                            position_ids=position_ids_from_cu(cu, cu, ids.numel()), max_seqlen=ids.numel())
        return model.logits(batch)
    return model, logits_of


def _hf_from_export(export: dict, folder, out, dtype):
    """transformers' model loaded from the exported (HF-named, per-expert) tensors."""
    from safetensors.torch import save_file

    out.mkdir()
    save_file({k: v.contiguous() for k, v in export.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text((folder / "config.json").read_text())
    return vc.hf_model(out, dtype)


def _reference(folder, dtype):
    """(per-row log-probs, entropies, loss, parameters after one AdamW step as HF state dict)."""
    from longctx_moe.hf.interop import to_hf_state_dict

    if dtype == "float32":
        model = vc.hf_model(folder, dtype)
        logits_of = lambda ids: model(input_ids=ids[None]).logits[0]
    else:
        model, logits_of = _our_logits(folder, dtype)
    data = vc.padded_batch()
    lps, ents, loss = vc.reference(logits_of, data, vc.actor_config())
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=vc.LR, eps=vc.EPS, weight_decay=0.0).step()
    state = model.state_dict() if dtype == "float32" else to_hf_state_dict(model)
    return lps, ents, loss.detach(), {k: v.detach() for k, v in state.items()}


def _check_rows(got_rows, want_rows, tol, what):
    for i, (got, want) in enumerate(zip(got_rows, want_rows, strict=True)):
        assert got.shape[0] == want.shape[0] + 1, f"{what} row {i}"
        assert float(got[-1]) == 0.0  # nothing scores the token after a row's last
        err = float((got[:-1].double() - want.double()).abs().max())
        assert err <= tol, f"{what} row {i}: max |diff| {err:.3g} > {tol}"


# (world, our parallel layout, verl's max_token_len_per_gpu): data parallel on 1 and 2 ranks;
# context parallel, where both ranks hold the same DP chunk; Dynamic-CP with expert parallel
# (EP2 x DP2) over two DP ranks, each with its own chunk and its half of the experts, where the
# 8-token budget per rank sends the 9-12-token sequences to runs over both ranks and the others
# to one rank each.
CASES = {"1": (1, [], 32), "dp2": (2, [], 32), "cp2": (2, ["parallel.cp=2"], 32),
         "dyncp2-ep2": (2, ["parallel.ep=2", "parallel.dynamic_cp=true", "parallel.max_cp=2"], 8),
         "dp2-distopt": (2, ["parallel.distributed_optimizer=true"], 32)}
# float32 on one rank (the 1e-5 bound); the layouts in float64, where any error of ours in the
# DP / CP / EP split stands out of the rounding (1e-10).
PARAMS = [("float32", "1"), ("float64", "1"), ("float64", "dp2"), ("float64", "cp2"),
          ("float64", "dyncp2-ep2")]
# verl's param_offload and optimizer_offload: every mode switch moves the parameters, gradients
# and optimizer state (the distributed optimizer's slabs on 2 ranks) out and back, same bounds.
OFFLOAD = [("float32", "1"), ("float64", "dp2-distopt")]


PASSES = [(dtype, case, False) for dtype, case in PARAMS] + [(dtype, case, True) for dtype, case in OFFLOAD]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """(dtype, case, offload) -> (its HF folder, each rank's `_engine_pass` result). The first
    test that asks for a pass runs every pass of its world size in one process group."""
    done: dict = {}

    def runs(dtype: str, case: str, offload: bool):
        world = CASES[case][0]
        if (dtype, case, offload) not in done:
            group = [p for p in PASSES if CASES[p[1]][0] == world]
            folders = {p: vc.save_hf_model(tmp_path_factory.mktemp(f"{p[0]}-{p[1]}-{p[2]}") / "hf", p[0])
                       for p in group}
            args = [(str(folders[p]), p[0], *CASES[p[1]][1:], p[2]) for p in group]
            per_rank = run_distributed(_engine_passes, world_size=world, args=(args,), timeout=600)
            done.update({p: (folders[p], [r[i] for r in per_rank]) for i, p in enumerate(group)})
        return done[dtype, case, offload]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("dtype,case", PARAMS, ids=[f"{d}-{c}" for d, c in PARAMS])
def test_training_worker_drives_the_engine_like_transformers_and_verl(tmp_path, engine_runs, dtype, case):
    _check_engine_pass(tmp_path, engine_runs, dtype, case, offload=False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,case", OFFLOAD, ids=[f"{d}-{c}" for d, c in OFFLOAD])
def test_training_worker_with_param_and_optimizer_offload(tmp_path, engine_runs, dtype, case):
    runs = _check_engine_pass(tmp_path, engine_runs, dtype, case, offload=True)
    assert all(run["away"] == ("params", "grads", "optimizer") and run["left"] == 0 for run in runs)


def _check_engine_pass(tmp_path, engine_runs, dtype, case, offload: bool) -> list[dict]:
    layout = CASES[case][1]
    folder, runs = engine_runs(dtype, case, offload)
    failed = [run for run in runs if isinstance(run, str)]
    assert not failed, failed[0]
    if not offload:
        assert all(run["away"] == () for run in runs)
    export = runs[0]["export"]
    # one result per DP chunk, in chunk order: verl's worker returns outputs on a replica's first
    # CP / TP rank only
    runs = sorted([run for run in runs if run["lp"] is not None], key=lambda run: run["dp_rank"])
    assert len(runs) == len({run["dp_rank"] for run in runs})
    lps, ents, loss, after = _reference(folder, dtype)
    tol = TOL[dtype]
    lp = [r for run in runs for r in run["lp"]]
    _check_rows(lp, lps, tol, "log_probs")
    _check_rows([r for run in runs for r in run["ent"]], ents, tol, "entropy")
    # TrainingWorker averages the per-rank loss sums over DP: every rank reports the global loss.
    # It sums the micro-batch losses as torch.tensor(list of floats), i.e. in float32: a loss of
    # ~0.06 is reported to ~4e-9 whatever the engine's precision (the float64 gradient check below
    # is the exact one).
    loss_tol = max(tol, 1e-7 * abs(float(loss)))
    for run in runs:
        assert abs(run["loss"][0] - float(loss)) <= loss_tol, (run["loss"], float(loss))
        assert abs(run["metrics"]["loss"] - float(loss)) <= loss_tol
        assert "grad_norm" in run["metrics"] and "actor/pg_loss" in run["metrics"]
    if "parallel.dynamic_cp=true" in layout:  # both kinds of run happened
        assert all(run["metrics"][f"actor/sequences_cp{s}"] > 0 for run in runs for s in (1, 2))
    hf = _hf_from_export(export, folder, tmp_path / "export", dtype)
    got = hf.state_dict()
    assert set(got) == set(after)
    for name, want in after.items():
        err = float((got[name].double() - want.double()).abs().max())
        assert err <= 10 * tol, f"{name}: updated weights differ by {err:.3g}"
    # The exported weights in transformers score like the engine after the update.
    if dtype == "float32":
        lp2_ref, _, _ = vc.reference(lambda ids: hf(input_ids=ids[None]).logits[0], vc.padded_batch(),
                                     vc.actor_config())
        _check_rows([r for run in runs for r in run["lp2"]], lp2_ref, tol, "log_probs after update")
    json.dumps(runs[0]["metrics"])  # plain floats, as verl's loggers need
    return runs
