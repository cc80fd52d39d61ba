"""Checkpoints that change layout: a state saved under one parallel layout loads under
another, compared tensor by tensor with the unsharded state (model, AdamW exp_avg / exp_avg_sq /
step, expert bias) through world 1 -> 8 (TP2 x CP2 x DP2, EP4) -> 4 (CP2 x DP2, EP2, AdamW state
sharded by the distributed optimizer) -> 4 (TP2 x DP2, EP4, replicated AdamW state) -> 1; and a run
trained on 2 ranks with `--set parallel.ep=2` resumed on one rank, then on 4 ranks with
`--set parallel.ep=4`, whose export loads in transformers."""

import json
from pathlib import Path

import pytest
import torch

from longctx_moe.build import model_of
from longctx_moe.checkpoint.trainer_state import load_trainer, save_trainer
from longctx_moe.config import load_config
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.train import main as train_main
from longctx_moe.train import run as train_run
from longctx_moe.trainer import Trainer
from tests.launcher import run_distributed
from tests.trainer.test_train_run import ROOT

MODEL = ["model.vocab_size=64", "model.hidden_size=32", "model.num_layers=3", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=8", "model.num_experts=8", "model.expert_hidden_size=16",
         "model.first_k_dense=1", "model.dense_hidden_size=32", "model.shared_expert_hidden_size=16",
         "model.expert_bias=true", "train.autocast_dtype=none", "optim.weight_decay=0.1"]
# (world size, parallel overrides) of each stage after the unsharded save.
STAGES = [(8, ["parallel.tp=2", "parallel.cp=2", "parallel.ep=4"]),
          (4, ["parallel.cp=2", "parallel.ep=2", "parallel.distributed_optimizer=true"]),
          (4, ["parallel.tp=2", "parallel.ep=4"]),
          (1, [])]
TP_ROWS = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "w_gate.weight", "w_up.weight")
TP_COLS = ("attn.wo.weight", "w_down.weight")
VOCAB = ("embed.weight", "lm_head.weight")


def _trainer(world: int, rank: int, sets: list[str], seed: int) -> Trainer:
    cfg = load_config(None, [*MODEL, *sets])
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
    dims.build_groups(rank)
    torch.manual_seed(seed)  # another init than the reference: loading must overwrite all of it
    return Trainer(cfg, parallelize(model_of(cfg), dims, cfg.parallel))


def reference_state() -> dict[str, torch.Tensor]:
    """The unsharded trainer after one AdamW step on fixed gradients, with a moved expert bias:
    `model.<name>` and `optim.<field>.<name>`, as a world-1 trainer holds them."""
    trainer = _trainer(1, 0, [], seed=0)
    gen = torch.Generator().manual_seed(1)
    for p in trainer.model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    trainer.optimizer.step()
    for layer in trainer.model.moe_layers():
        layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape, generator=gen))
    trainer.step = 1
    return _state(trainer)


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v for k, (v, _) in _state_and_slabs(trainer).items()}


def _state_and_slabs(trainer: Trainer) -> dict[str, tuple[torch.Tensor, object]]:
    """{key: (tensor, the distributed optimizer's slab it covers, or None)}."""
    out = {f"model.{k}": (v.clone(), None) for k, v in trainer.model.state_dict().items()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    slab_of = getattr(trainer.optimizer, "slab_of", lambda t: None)
    for t, st in trainer.optimizer.state.items():
        slab = slab_of(t)
        name = names[id(t if slab is None else slab.param)]
        for field, v in st.items():
            out[f"optim.{field}.{name}"] = (v.clone(), None if v.ndim == 0 else slab)
    return out


def expected_piece(key: str, whole: torch.Tensor, dims: ParallelDims, local: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `whole`, by the sharding rules written out by name (independent of
    sharded_state.global_slices): experts along dim 0 over EP, TP rows / columns; the vocabulary
    rows of the embedding and LM head over TP where the layout shards them (`local` is 1/tp)."""
    if whole.ndim == 0:
        return whole
    if ".experts." in key:
        return whole.chunk(dims.ep, 0)[dims.rank_in("ep")]
    vocab_sharded = key.endswith(VOCAB) and local.shape[0] * dims.tp == whole.shape[0] and dims.tp > 1
    if key.endswith(TP_ROWS) or vocab_sharded:
        return whole.chunk(dims.tp, 0)[dims.rank_in("tp")]
    if key.endswith(TP_COLS):
        return whole.chunk(dims.tp, 1)[dims.rank_in("tp")]
    return whole


def _load_check_save(rank, world, sets, src, dst, ref):
    trainer = _trainer(world, rank, sets, seed=100 + rank)
    load_trainer(trainer, None, Path(src), rank, world)
    got = _state_and_slabs(trainer)
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    for key, whole in ref.items():
        value, slab = got[key]
        if slab is None:
            want = expected_piece(key, whole, trainer.dims, value)
        else:  # distributed optimizer: this rank's slab of its piece of the parameter
            want = expected_piece(key, whole, trainer.dims, slab.param)
            want = want.narrow(slab.dim, slab.start, slab.sizes[slab.rank])
        assert torch.equal(value, want), f"rank {rank}: {key}"
    assert trainer.step == 1 and trainer.schedule.step_index == 0
    return str(save_trainer(trainer, None, Path(dst), rank, world, keep_last=0))


@pytest.mark.slow
def test_round_trip_through_layouts_equals_the_unsharded_state(tmp_path):
    ref = reference_state()
    trainer = _trainer(1, 0, [], seed=0)
    trainer.model.load_state_dict({k[6:]: v for k, v in ref.items() if k.startswith("model.")})
    trainer.optimizer.load_state_dict(_optimizer_dict(trainer, ref))
    trainer.step = 1
    src = str(save_trainer(trainer, None, tmp_path / "s0", 0, 1, keep_last=0))
    for i, (world, sets) in enumerate(STAGES, start=1):
        dst = tmp_path / f"s{i}"
        src = run_distributed(_load_check_save, world, args=(sets, src, dst, ref), timeout=900)[0]
        meta = json.loads((Path(src) / "meta.json").read_text())
        # Each piece is written once: replicas (DP, CP and TP copies) are not repeated.
        for key, entry in meta["tensors"].items():
            numel = sum(torch.Size(p["shape"]).numel() for p in entry["pieces"])
            assert numel == torch.Size(entry["global_shape"]).numel(), key
    # The last stage ran on one rank: its own check compared the whole tensors with `ref`.


def _optimizer_dict(trainer: Trainer, ref: dict[str, torch.Tensor]) -> dict:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    state = {i: {f: ref[f"optim.{f}.{names[id(p)]}"] for f in ("step", "exp_avg", "exp_avg_sq")}
             for i, p in enumerate(params)}
    return {"state": state, "param_groups": trainer.optimizer.state_dict()["param_groups"]}


# ---------------------------------------------------------------------- through the launcher


SHORT = ["data.global_batch_tokens=1024", "data.micro_batch_tokens=512", "optim.warmup_steps=1",
         "logging.peak_tflops=1.0", "logging.progress_bar=false", "train.num_threads=1",
         "train.autocast_dtype=none", "checkpoint.keep_last=0",
         "optim.schedule=constant"]  # the learning rate of a step does not depend on train.steps


def _argv(run_dir, corpus, steps, *extra):
    sets = [*SHORT, f"train.steps={steps}", f"train.run_dir={run_dir}", f"data.path={corpus}", *extra]
    return ["--config", str(ROOT / "configs/tiny_cpu.yaml")] + [a for s in sets for a in ("--set", s)]


def _rank_train(rank, world, run_dir, corpus, steps, extra):
    """The trainer's run on this rank, as `longctx-moe train --nproc` runs it; the steps it ran."""
    sets = [*SHORT, f"train.steps={steps}", f"train.run_dir={run_dir}", f"data.path={corpus}", *extra]
    return [r["step"] for r in train_run(load_config(ROOT / "configs/tiny_cpu.yaml", sets))["records"]]


def _train(nproc, run_dir, corpus, steps, *extra):
    """Train on `nproc` gloo ranks (forked from the preloaded test server: the launcher's own
    start-up is tested in test_train_run and test_faults); the steps each rank ran."""
    return run_distributed(_rank_train, nproc, args=(run_dir, corpus, steps, extra), timeout=900)


def _losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.mark.slow
def test_ep2_run_resumes_on_one_rank_then_on_four_with_ep4_and_exports(tmp_path, corpus, capsys):
    from tests.trainer.test_export_hf import _export, _hf_logits_match_ours

    ref = tmp_path / "ref"
    assert train_main(_argv(ref, corpus, 4)) == 0
    run = tmp_path / "run"
    assert _train(2, run, corpus, 2, "parallel.ep=2") == [[1, 2]] * 2
    capsys.readouterr()
    assert train_main(_argv(run, corpus, 3)) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in out
    assert "notice: the data-parallel size changed from 2 to 1" in out
    # Every rank resumed from the one-rank run's step-3 checkpoint and ran step 4 only.
    assert _train(4, run, corpus, 4, "parallel.ep=4") == [[4]] * 4
    got, want = _losses(run), _losses(ref)
    assert sorted(got) == [1, 2, 3, 4]
    # float32 throughout; the layouts only reorder sums (gradient all-reduces, expert order
    # within a dispatch): ~1e-7 relative per step, far below the ~1e-2 a step changes the loss.
    for step in (1, 2, 3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5)
    _hf_logits_match_ours(run, _export(run, tmp_path / "hf"))
