"""One rank of a large job rehearsed on this CPU (`longctx-moe rehearse`): the real trainer,
runtime, dispatchers and optimizer on meta tensors under a fake process group, with a CUDA
device's ops. Shrunk shapes of the published models (two layers), so that the suite keeps the
GPU path at scale from breaking unseen. Each rehearsal runs in processes of its own."""

import pytest

from tests.rehearsal.helpers import rehearse_one


def _rehearse(tmp_path, config: str, world: int, rank: int, *sets: str) -> dict:
    return rehearse_one(tmp_path, "--config", config, "--world", str(world), "--rank", str(rank), "--tokens",
                        "4096", "--gpu", "h100", sets=("model.num_layers=2", *sets))


@pytest.mark.slow
def test_a_shrunk_qwen3_30b_a3b_on_8_ranks_with_and_without_full_recompute(tmp_path):
    """The config's layout (EP8, distributed optimizer, full recompute) and the same without
    recompute: full recompute keeps far fewer activations at the step's peak, and parameters,
    gradients and optimizer state do not move."""
    r = {m: _rehearse(tmp_path, "configs/rehearsal/qwen3-30b-a3b.yaml", 8, 3, f"train.recompute={m}")
         for m in ("none", "full")}
    full = r["full"]
    assert full["roles"]["ep"] == 3
    experts = 2 * (128 // 8) * 3 * 2048 * 768  # 2 layers x 16 local experts x gate / up / down
    assert experts < full["params"] < experts + 2 * 151936 * 2048 + 2 * 20 * 2048 * 2048
    split = full["peak_split"]
    assert split["parameters"] == 4 * full["params"]  # float32 masters
    assert split["activations"] > 0 and split["optimizer state"] > 0 and full["fits"]
    assert full["traffic"]["ep[0..7] all_to_all"]["calls"] >= 4  # dispatch and combine, both ways
    assert full["traffic"]["dp_cp[0..7] reduce_scatter"]["payload_bytes"] > 0  # the distributed optimizer
    reads = dict(full["host_reads"])
    # one read of the routing counts per MoE layer forward: 2 layers, run again by the recompute
    assert reads.pop("routing counts (parallel/comm.py RoutingCounts.read)") == 2 * 2
    assert sum(reads.values()) <= 2, reads  # the step's one read-back and the gradient norm
    assert full["step_seconds"]["total_s"] > 0 and full["launches"] > 0
    # Two blocks of 4096 tokens keep about 0.7 GiB each without recompute and only their 32 MiB
    # float32 input under full; the LM head's chunked loss (not recomputed) is the rest of the peak.
    # (the all-to-alls' receive buffers the blocks keep are filed as communication buffers)
    act = {m: r[m]["peak_split"]["activations"] + r[m]["peak_split"]["communication buffers"] for m in r}
    assert act["none"] - act["full"] > 1.2 * 2**30
    for key in ("parameters", "gradients", "optimizer state"):
        assert len({r[m]["peak_split"][key] for m in r}) == 1, key
    # the recomputation runs every block's forward again, the EP all-to-alls included
    assert full["traffic"]["ep[0..7] all_to_all"]["calls"] > r["none"]["traffic"]["ep[0..7] all_to_all"]["calls"]
    assert full["flops"] > r["none"]["flops"]


@pytest.mark.slow
def test_a_shrunk_deepseek_v3_with_mla_on_16_ranks(tmp_path):
    r = _rehearse(tmp_path, "configs/rehearsal/deepseek-v3.yaml", 16, 5, "model.first_k_dense=1",
                  "parallel.ep=16")
    assert r["roles"]["ep"] == 5 and r["roles"]["tp"] == 5 and r["fits"]  # the config's TP8 with SP
    assert r["traffic"]["ep[0..15] all_to_all"]["calls"] >= 2
    assert r["traffic"]["tp[0..7] reduce_scatter"]["calls"] > 0  # sequence parallelism's
    assert r["peak_split"]["parameters"] == 4 * r["params"]
