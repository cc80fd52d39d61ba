"""Hugging Face interop on disk: `longctx-moe export-hf` of runs trained on 2 ranks under EP2 and
TP2, loaded by transformers' from_pretrained and compared with our single-device model on packed
multi-document input; `train.init_from` starting a run (under another layout) from the export;
one-line refusals with exit status 2."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from longctx_moe.cli import main as cli_main
from longctx_moe.config import load_config, write_config
from longctx_moe.hf.export import checkpoint_step_dir, consolidated_state, load_consolidated_model
from longctx_moe.train import main as train_main
from longctx_moe.train import run as train_run
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["data.global_batch_tokens=1024", "data.micro_batch_tokens=512", "optim.warmup_steps=1",
         "logging.peak_tflops=1.0", "logging.progress_bar=false", "train.num_threads=1",
         "checkpoint.resume=none"]


def _overrides(run_dir, corpus, steps, *extra):
    return [*SHORT, f"train.steps={steps}", f"train.run_dir={run_dir}", f"data.path={corpus}", *extra]


def _sets(run_dir, corpus, steps, *extra):
    return ["--config", str(ROOT / "configs/tiny_cpu.yaml")] + [
        a for s in _overrides(run_dir, corpus, steps, *extra) for a in ("--set", s)]


def _rank_train(rank, world, overrides):
    return [r["step"] for r in train_run(load_config(ROOT / "configs/tiny_cpu.yaml", overrides))["records"]]


def _train_nproc2(run_dir, corpus, steps, *extra):
    """The run `longctx-moe train --nproc 2` makes, on two gloo ranks forked from the preloaded
    test server (the launcher's own start-up is tested in test_train_run and below)."""
    ran = run_distributed(_rank_train, 2, args=(_overrides(run_dir, corpus, steps, *extra),), timeout=400)
    assert ran == [list(range(1, steps + 1))] * 2
    return run_dir


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, corpus):
    return _train_nproc2(tmp_path_factory.mktemp("ep") / "run", corpus, 2, "parallel.ep=2")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, corpus):
    return _train_nproc2(tmp_path_factory.mktemp("tp") / "run", corpus, 2, "parallel.tp=2")


def _export(run_dir, out, *flags):
    assert cli_main(["export-hf", str(run_dir), str(out), "--dtype", "fp32", *flags]) == 0
    return out


def _rank_model(run_dir, rank, step=2):
    """The model pieces rank `rank` wrote (its own shards; replicated tensors are in rank 0's)."""
    path = run_dir / "checkpoints" / f"step_{step:08d}" / f"rank_{rank:05d}.safetensors"
    return {k[len("model."):]: v for k, v in safetensors_torch.load_file(str(path)).items() if k.startswith("model.")}


def _hf_logits_match_ours(run_dir, out):
    cfg = load_config(run_dir / "config.yaml")
    ours = load_consolidated_model(cfg, checkpoint_step_dir(cfg, run_dir, None))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    # Three documents packed in one row: HF separates them by the position ids restarting at 0.
    batch = packed_batch([23, 9, 17], cfg.model.vocab_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours.logits(batch)
        theirs = hf(input_ids=batch.tokens[None], position_ids=batch.position_ids[None]).logits[0]
    # float32 on both sides; the same weights and ops in another order (HF's eager attention and
    # per-expert loop vs our kernels): ~1e-6 differences on logits of size ~1.
    assert mine.abs().max() > 0.1
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    # Packing matters: the second document alone gives the same logits as inside the pack.
    alone = packed_batch([9], cfg.model.vocab_size, tokens=batch.tokens[23:32].clone())
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(alone), mine[23:32], atol=1e-5, rtol=1e-5)
    return ours


@pytest.mark.slow
def test_export_ep2_run_loads_in_transformers_and_matches(ep_run, tmp_path, capsys):
    out = _export(ep_run, tmp_path / "hf", "--max-shard-size", "0.003")  # 3 MB: several shards
    report = capsys.readouterr().out
    assert "safetensors shard(s)" in report and "tokenizer: copied" in report
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]
    ours = _hf_logits_match_ours(ep_run, out)

    # Consolidation against the rank files: EP rank r holds experts [4r, 4r+4) of each layer.
    sd = ours.state_dict()
    for rank in (0, 1):
        part = _rank_model(ep_run, rank)
        assert torch.equal(part["layers.0.ffn.experts.w_down"], sd["layers.0.ffn.experts.w_down"][4 * rank:4 * rank + 4])
    files = {}
    for p in shards:
        files.update(safetensors_torch.load_file(str(p)))
    w_gate_up_D2F = sd["layers.1.ffn.experts.w_gate_up"][5]
    assert torch.equal(files["model.layers.1.mlp.experts.5.gate_proj.weight"], w_gate_up_D2F[:, 0].t())
    assert torch.equal(files["model.layers.1.mlp.experts.5.up_proj.weight"], w_gate_up_D2F[:, 1].t())

    # The tokenizer loads through transformers and encodes as the corpus' tokenizer does.
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode("def f(x): return x") == Tokenizer.from_file(str(out / "tokenizer.json")).encode("def f(x): return x").ids
    assert tok.eos_token == "<|endoftext|>"


@pytest.mark.slow
def test_export_tp2_run_then_init_from_under_another_layout(tp_run, corpus, tmp_path):
    out = _export(tp_run, tmp_path / "hf")
    assert len(list(out.glob("model-*-of-*.safetensors"))) == 1  # tiny model under the 2 GB cap
    ours = _hf_logits_match_ours(tp_run, out)
    sd = ours.state_dict()
    parts = [_rank_model(tp_run, r) for r in (0, 1)]
    assert torch.equal(torch.cat([p["layers.0.attn.wq.weight"] for p in parts], 0), sd["layers.0.attn.wq.weight"])
    assert torch.equal(torch.cat([p["layers.1.attn.wo.weight"] for p in parts], 1), sd["layers.1.attn.wo.weight"])

    # A new run under EP2 starts from the export: with lr 1e-20 one AdamW step moves no fp32
    # weight by a representable amount (|update| ~ lr << ulp), so its step-1 checkpoint holds
    # exactly the initial parameters, which must be the exported ones.
    init_run = _train_nproc2(tmp_path / "init", corpus, 1, "parallel.ep=2", f"train.init_from={out}",
                             "optim.lr=1e-20")
    cfg = load_config(init_run / "config.yaml")
    started = consolidated_state(cfg, checkpoint_step_dir(cfg, init_run, 1))
    for name, t in sd.items():
        assert torch.equal(started[name], t), name


@pytest.mark.slow
def test_init_from_mismatched_config_is_one_line(ep_run, corpus, tmp_path, capsys):
    out = _export(ep_run, tmp_path / "hf")
    capsys.readouterr()
    rc = train_main(_sets(tmp_path / "r", corpus, 1, f"train.init_from={out}", "model.num_experts=4"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "config.json gives model.num_experts=8 but the config sets model.num_experts=4" in err


@pytest.mark.slow
def test_resume_ignores_init_from_with_a_notice(ep_run, tmp_path, capsys):
    out = _export(ep_run, tmp_path / "hf")
    run = tmp_path / "run"
    shutil.copytree(ep_run, run)
    cfg = load_config(ep_run / "config.yaml")
    capsys.readouterr()
    # On one rank (EP1 reads the EP2 checkpoint): the notice does not depend on the layout.
    rc = train_main(["--config", str(run / "config.yaml"), "--set", f"train.run_dir={run}",
                     "--set", "checkpoint.resume=auto", "--set", f"train.init_from={out}",
                     "--set", f"train.steps={cfg.train.steps}", "--set", "parallel.ep=1"])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert f"resumed from {run / 'checkpoints' / f'step_{cfg.train.steps:08d}'}" in stdout
    assert f"train.init_from={out} is ignored (the checkpoint wins)" in stdout


def _one_line_error(argv, capsys):
    rc = cli_main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.mark.slow
def test_refused_model_and_bad_checkpoints_are_one_line(ep_run, tmp_path, capsys):
    sigmoid = tmp_path / "sigmoid"
    write_config(load_config(ep_run / "config.yaml", ["model.router_score=sigmoid"]), sigmoid / "config.yaml")
    err = _one_line_error(["export-hf", str(sigmoid), str(tmp_path / "o1")], capsys)
    assert "qwen3_moe cannot express this model: model.router_score must be 'softmax'" in err

    empty = tmp_path / "empty"
    write_config(load_config(ep_run / "config.yaml", [f"train.run_dir={empty}"]), empty / "config.yaml")
    assert "holds no checkpoint" in _one_line_error(["export-hf", str(empty), str(tmp_path / "o2")], capsys)
    assert "pick --step from" in _one_line_error(["export-hf", str(ep_run), str(tmp_path / "o3"), "--step", "7"], capsys)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(ep_run, corrupt)
    write_config(load_config(ep_run / "config.yaml", [f"train.run_dir={corrupt}"]), corrupt / "config.yaml")
    rank1 = corrupt / "checkpoints" / "step_00000002" / "rank_00001.safetensors"
    data = bytearray(rank1.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank1.write_bytes(bytes(data))
    err = _one_line_error(["export-hf", str(corrupt), str(tmp_path / "o4")], capsys)
    assert str(rank1) in err and "sha256" in err


@pytest.mark.slow
def test_init_from_reads_a_transformers_saved_directory(ep_run, tmp_path):
    """What from_pretrained + save_pretrained writes (fused or per-expert names, whichever
    transformers 5 chooses) reads back into exactly our consolidated weights."""
    from longctx_moe.hf.load import load_hf_model

    out = _export(ep_run, tmp_path / "hf")
    resaved = tmp_path / "resaved"
    transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).save_pretrained(resaved)
    cfg = load_config(ep_run / "config.yaml")
    want = load_consolidated_model(cfg, checkpoint_step_dir(cfg, ep_run, None)).state_dict()
    got = load_hf_model(resaved).state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        if not name.endswith("expert_bias"):  # ours alone: HF routing is a zero bias
            assert torch.equal(got[name], t), name


@pytest.mark.slow
def test_init_from_reads_fused_expert_names(ep_run, tmp_path):
    """transformers 5's in-memory layout (`experts.gate_up_proj` [E, 2F, D]) is accepted too."""
    from longctx_moe.hf.interop import to_hf_state_dict
    from longctx_moe.hf.load import load_hf_model

    out = _export(ep_run, tmp_path / "hf")
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copyfile(out / "config.json", fused / "config.json")
    cfg = load_config(ep_run / "config.yaml")
    model = load_consolidated_model(cfg, checkpoint_step_dir(cfg, ep_run, None))
    sd = to_hf_state_dict(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    safetensors_torch.save_file(sd, str(fused / "model.safetensors"))
    got = load_hf_model(fused).state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items() if not k.endswith("expert_bias"))
