"""Metrics: expert-load statistics, the JSONL writer, MFU inputs, and the CLI's plan-groups hook."""

import json

import pytest
import torch

from longctx_moe.cli import main as cli_main
from longctx_moe.metrics import MetricsLogger, ep_load_stats, expert_load_stats, step_flops
from longctx_moe.model.config import ModelConfig


def test_expert_load_stats_per_layer():
    counts = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0], [0, 0, 0, 0]])
    s = expert_load_stats(counts)
    assert s["expert_load_min"] == [1.0, 0.0, 0.0]
    assert s["expert_load_max"] == [1.0, 4.0, 0.0]
    assert s["expert_load_cv"][0] == 0.0 and s["expert_load_cv"][1] == pytest.approx(3**0.5, abs=1e-4)
    assert s["expert_load_cv"][2] == 0.0  # a layer that routed nothing is not NaN


def test_ep_load_stats_by_owner_and_as_run():
    # 2 EP ranks: experts 0-1 on rank 0, 2-3 on rank 1
    counts = torch.tensor([[10, 10, 10, 10], [30, 10, 0, 0], [0, 0, 0, 0]])
    assert ep_load_stats(counts, 2) == {"ep_load_max": [1.0, 2.0, 0.0]}
    ran = [[20, 20], [25, 15], [0, 0]]  # lending moved 15 of rank 0's rows in layer 1
    assert ep_load_stats(counts, 2, ran)["ep_run_max"] == [1.0, 1.25, 0.0]
    # no MoE layer (every layer dense, EP > 1): nothing to report, not a reshape error
    assert ep_load_stats(torch.zeros(0, 4), 2) == {"ep_load_max": []}


def test_metrics_file_is_json_lines_even_for_nan(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(path, total_steps=2, progress_bar=False)
    base = {"lr": 1e-3, "tokens_per_s": 10.0, "mfu": None}
    logger.log({"step": 1, "loss": float("nan"), **base})
    logger.log({"step": 2, "loss": 2.5, **base}, write=False)  # counted, not written
    logger.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": "nan", **base}]


def test_step_flops_grow_with_attention_over_real_lengths():
    cfg = ModelConfig()
    one_doc, split = step_flops(cfg, [1024]), step_flops(cfg, [512, 512])
    assert one_doc > split > 0  # same tokens; attention is quadratic in each document's length


def test_plan_groups_subcommand_prints_the_layouts_groups(capsys):
    rc = cli_main(["plan-groups", "--world", "4", "--tp", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert lines[0] == "world 4: attention tp=2 cp=1 dp=2 | moe etp=1 ep=1 edp=4"
    groups = dict(line.split(maxsplit=1) for line in lines[1:])
    # TP is the fastest axis: TP peers are neighbours and DP strides over them; without EP every
    # rank holds every expert, so all four ranks form the one expert-data-parallel group.
    assert groups["tp"] == "{0,1} {2,3}" and groups["dp"] == "{0,2} {1,3}"
    assert groups["edp"] == "{0,1,2,3}" and groups["ep"] == "{0} {1} {2} {3}"
