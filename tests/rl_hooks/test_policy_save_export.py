"""`longctx-moe export-hf` of a PolicyTrainer.save folder: the save writes its config.yaml, and the
corpus tokenizer is found whatever directory the export runs from."""

from __future__ import annotations

import torch

from longctx_moe.cli import main
from longctx_moe.hf.load import load_hf_model
from rl_hooks.api import PolicyTrainer
from tests.rl_hooks.helpers import config


def test_export_hf_of_a_policy_save_folder_with_a_relative_data_path(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(corpus.parent)  # data.path relative to where the RL job runs
    policy = PolicyTrainer(config(f"data.path={corpus.name}", "model.shared_expert_hidden_size=0"))
    policy.save(str(tmp_path / "save"))
    monkeypatch.chdir(tmp_path)  # exported later, from elsewhere
    assert main(["export-hf", str(tmp_path / "save"), str(tmp_path / "hf")]) == 0
    report = capsys.readouterr().out
    assert "tokenizer: copied" in report, report
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (corpus / "tokenizer.json").read_text()
    # The exported float32 weights are the float64 model's, rounded once.
    got = load_hf_model(tmp_path / "hf").state_dict()
    for name, p in policy.runtime.model.state_dict().items():
        torch.testing.assert_close(got[name].double(), p.double(), rtol=1e-7, atol=1e-7)
