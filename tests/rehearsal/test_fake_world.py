"""One rank of a large job rehearsed on this CPU (`longctx-moe rehearse`): the real trainer,
runtime, dispatchers and optimizer on meta tensors under a fake process group, with a CUDA
device's ops. Shrunk shapes of the published models (two layers), so that the suite keeps the
GPU path at scale from breaking unseen. Each rehearsal runs in processes of its own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rehearse(tmp_path, config: str, world: int, rank: int, *sets: str) -> dict:
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "longctx_moe.cli", "rehearse", "--config", config, "--world", str(world),
           "--rank", str(rank), "--tokens", "4096", "--gpu", "h100", "--out", str(out)]
    cmd += [a for s in ("model.num_layers=2", *sets) for a in ("--set", s)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "peak GiB" in done.stdout
    (report,) = json.loads(out.read_text())["ranks"]
    return report


@pytest.mark.slow
def test_a_shrunk_qwen3_30b_a3b_on_8_ranks(tmp_path):
    r = _rehearse(tmp_path, "configs/rehearsal/qwen3-30b-a3b.yaml", 8, 3)
    assert r["roles"]["ep"] == 3
    experts = 2 * (128 // 8) * 3 * 2048 * 768  # 2 layers x 16 local experts x gate / up / down
    assert experts < r["params"] < experts + 2 * 151936 * 2048 + 2 * 20 * 2048 * 2048
    split = r["peak_split"]
    assert split["parameters"] == 4 * r["params"]  # float32 masters
    assert split["activations"] > 0 and split["optimizer state"] > 0 and r["fits"]
    assert r["traffic"]["ep[0..7] all_to_all"]["calls"] >= 4  # dispatch and combine, both ways
    assert r["traffic"]["dp_cp[0..7] reduce_scatter"]["payload_bytes"] > 0  # the distributed optimizer
    assert sum(r["host_reads"].values()) <= 4  # the step's one read-back, the grad norm, the routing
    assert r["step_seconds"]["total_s"] > 0 and r["launches"] > 0


@pytest.mark.slow
def test_a_shrunk_deepseek_v3_with_mla_on_16_ranks(tmp_path):
    r = _rehearse(tmp_path, "configs/rehearsal/deepseek-v3.yaml", 16, 5, "model.first_k_dense=1",
                  "parallel.ep=16", "parallel.tp=1", "parallel.sequence_parallel=false", "execution.fp8=none",
                  "execution.fp8_recipe=tensor", "train.recompute=selective")
    assert r["roles"]["ep"] == 5 and r["fits"]
    assert r["traffic"]["ep[0..15] all_to_all"]["calls"] >= 2
    assert r["peak_split"]["parameters"] == 4 * r["params"]
