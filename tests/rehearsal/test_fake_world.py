"""Prototype: one rank of a fake 8-rank job, a shrunk Qwen3-30B-A3B on meta with EP 8. Each test
runs in a process of its own (one default process group per process)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SETUP = """
import torch
from longctx_moe.config import config_from_dict
from longctx_moe.hf.config_file import fill_model_from_file
from longctx_moe.rehearsal.fake_world import build_rank, fake_world, first_failure, host_batch, meta_batch, run_micro_batch
data = {"model": {}, "parallel": {"ep": 8}, "data": {"micro_batch_tokens": 4096}}
fill_model_from_file(data, "configs/models/qwen3-30b-a3b.json")
data["model"]["num_layers"] = 2
cfg = config_from_dict(data)
batch = host_batch([1000, 3000, 96])
"""


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", _SETUP + code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_rank_holds_its_share_of_the_experts():
    out = _run("""
with fake_world(8, rank=3):
    dims, rt = build_rank(cfg, 8, 3)
    n = sum(p.numel() for p in rt.model.parameters())
    experts = sum(p.numel() for b in rt.model.layers for p in b.ffn.experts.parameters())
    print(dims.rank_in("ep"), experts, n)
""")
    ep_rank, experts, total = map(int, out.split())
    assert ep_rank == 3
    assert experts == 2 * (128 // 8) * 3 * 2048 * 768  # 2 layers x 16 local experts x gate/up/down


def test_the_step_runs_through_with_the_standins_and_fails_without():
    out = _run("""
from longctx_moe.rehearsal.standins import host_reads, standins
with fake_world(8, rank=3):
    dims, rt = build_rank(cfg, 8, 3, torch.bfloat16)
    print(first_failure(lambda: run_micro_batch(rt, meta_batch(batch))))
    with standins():
        print(first_failure(lambda: run_micro_batch(rt, meta_batch(batch))))
""")
    without, with_standins = out.strip().splitlines()[-2:]
    # The document bounds stay on the host (no longer the first failure): the step still fails
    # further on without the stand-ins.
    assert without != "None" and "doc_layout" not in without
    assert with_standins == "None"
