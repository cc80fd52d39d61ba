"""The README's examples, run as written: each fenced block after a `<!-- readme-example: NAME -->`
line is taken from README.md as it stands, so an example that breaks (a renamed flag or key, a
config that no longer loads, an engine verl no longer selects) fails here.

What the test changes, and only that: where things are written (`--output`, `train.run_dir`, a
temporary directory instead of the repository), how many documents are packed (`--max-docs`), the
packed data the train example reads (the pack example's output, since the test cannot assume
`make train` ran), and, for verl, the model folder (a random Qwen3-MoE of the example's own
architecture, saved by transformers) and the sections the README leaves to
configs/verl_engine.yaml (optimizer, checkpoint).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = re.compile(r"^<!-- readme-example: (\w+) -->\n```(\w+)\n(.*?)\n```$", re.M | re.S)
NAMES = {"train": "bash", "pack": "bash", "verl": "yaml"}
# The pack example packs 400 documents (~5 s); 100 keep the test short and still fill the train
# example's 8,192-token steps many times over.
PACK_DOCS = "100"


def readme_examples() -> dict[str, str]:
    found = EXAMPLE.findall((ROOT / "README.md").read_text())
    names = [name for name, _, _ in found]
    assert sorted(names) == sorted(NAMES), f"README examples {names}, expected each of {sorted(NAMES)} once"
    for name, lang, _ in found:
        assert lang == NAMES[name], f"README example {name} is fenced as {lang}, expected {NAMES[name]}"
    return {name: body for name, _, body in found}


def _argv(block: str) -> list[str]:
    """One shell command (backslash continuations joined), its program resolved in this venv."""
    argv = shlex.split(block.replace("\\\n", " "))
    program = Path(argv[0])
    assert program.parent == Path(".venv/bin"), f"README command {argv[0]} is not one of the venv's"
    return [str(Path(sys.executable).parent / program.name), *argv[1:]]


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return [*argv[:i + 1], value, *argv[i + 2:]]
    return [*argv, flag, value]


def _overrides(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")


def _with_override(argv: list[str], key: str, value: str) -> list[str]:
    """`--set key=value`: the example's own setting of `key` replaced, else appended."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--set" and out[i + 1].split("=", 1)[0] == key:
            out[i + 1] = f"{key}={value}"
            return out
    return [*out, "--set", f"{key}={value}"]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


def test_readme_examples_are_marked_and_use_the_clis():
    ex = readme_examples()
    assert _argv(ex["train"])[1] == "train" and Path(_argv(ex["train"])[0]).name == "longctx-moe"
    assert Path(_argv(ex["pack"])[0]).name == "longctx-pack"
    shown = yaml.safe_load(ex["verl"])
    assert shown["engine_config"]["strategy"] == "longctx_moe"
    assert shown["model_config"]["external_lib"] == "rl_hooks.plugins.verl"


@pytest.mark.slow
def test_pack_then_train_examples(tmp_path):
    ex = readme_examples()
    data, run_dir = tmp_path / "data", tmp_path / "run"
    pack = _with_flag(_with_flag(_argv(ex["pack"]), "--output", str(data)), "--max-docs", PACK_DOCS)
    proc = _run(pack)
    assert "complete" in proc.stderr + proc.stdout
    stats = json.loads((data / "metadata.json").read_text())["stats"]
    assert stats["docs_in"] == int(PACK_DOCS) and stats["tokens_lost"] == 0 and stats["tokens_out"] > 0

    shown = _argv(ex["train"])
    train = _with_override(_with_override(shown, "train.run_dir", str(run_dir)), "data.path", str(data))
    proc = _run(train)
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    # every setting the example makes took effect (the two the test redirects aside)
    for key, value in _overrides(shown).items():
        if key not in ("train.run_dir", "data.path"):
            assert _lookup(resolved, key) == yaml.safe_load(value), key
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, resolved["train"]["steps"] + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert "metrics:" in proc.stdout


def _verl_pass(rank: int, world: int, shown_yaml: str, folder: str) -> dict:
    """Build verl's TrainingWorker from the README's YAML and drive it once as verl's PPO step
    does: old log-probs, one update with verl's ppo_loss, log-probs again."""
    import torch
    from omegaconf import OmegaConf
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from tests.rl_hooks import verl_cases as vc

    shown = OmegaConf.create(shown_yaml)
    base = OmegaConf.load(ROOT / "configs" / "verl_engine.yaml")
    cfg = OmegaConf.merge(
        {k: base[k] for k in ("optimizer_config", "checkpoint_config")}, shown,
        # the random model is saved without a tokenizer; a large lr so one step moves bf16 log-probs
        {"model_config": {"path": folder, "load_tokenizer": False},
         "engine_config": {"config": str(ROOT / shown.engine_config.config)},
         "optimizer_config": {"lr": 1e-2}})
    assert "rl_hooks.plugins.verl" not in sys.modules  # the YAML's external_lib brings it
    parts = {k: omega_conf_to_dataclass(cfg[k]) for k in
             ("model_config", "engine_config", "optimizer_config", "checkpoint_config")}
    engine_cls = EngineRegistry.get_engine_cls(cfg.model_type, cfg.engine_config.strategy)
    worker = TrainingWorker(TrainingWorkerConfig(model_type=cfg.model_type, **parts))
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=vc.actor_config()))
    data = vc.padded_batch()

    def log_probs():
        td = data.clone()
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=1.0)
        return [x.clone() for x in tu.get(worker.infer_batch(td), "log_probs").unbind()]

    before = log_probs()
    td = data.clone()
    b = data.batch_size[0]
    tu.assign_non_tensor(td, calculate_entropy=True, global_batch_size=b, mini_batch_size=b, epochs=1,
                         seed=0, dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
    loss = list(tu.get(worker.train_mini_batch(td), "metrics")["loss"])
    after = log_probs()
    return {"engine": engine_cls.__module__, "worker_engine": type(worker.engine).__module__,
            "lengths": [len(x) for x in before], "tokens": [int(n) for n in data["input_ids"].offsets().diff()],
            "finite": all(bool(torch.isfinite(x).all()) for x in before + after),
            "moved": any(not torch.equal(x, y) for x, y in zip(before, after, strict=True)), "loss": loss}


@pytest.mark.slow
def test_verl_example_selects_and_trains_our_engine(tmp_path):
    pytest.importorskip("verl")
    from transformers import Qwen3MoeForCausalLM

    from longctx_moe.config import load_config
    from longctx_moe.hf.interop import to_hf_config
    from tests.launcher import run_distributed

    shown = readme_examples()["verl"]
    # a Hugging Face folder whose config.json agrees with the example's own YAML (model.*)
    ours = load_config(ROOT / yaml.safe_load(shown)["engine_config"]["config"])
    folder = tmp_path / "hf"
    Qwen3MoeForCausalLM(to_hf_config(ours.model)).save_pretrained(folder)
    (run,) = run_distributed(_verl_pass, world_size=1, args=(shown, str(folder)), timeout=600)
    assert run["engine"] == run["worker_engine"] == "rl_hooks.plugins.verl.engine"
    assert run["lengths"] == run["tokens"]  # one log-prob per token of each sequence
    assert run["finite"] and all(math.isfinite(x) for x in run["loss"])
    assert run["moved"]  # the update reached the weights the next scoring pass uses
