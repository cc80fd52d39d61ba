"""`longctx-moe rehearse --rl`: one RL policy step (compute_logprobs, a GRPO update, the weight
export) of one rank of the shrunk Qwen3-30B-A3B on 8 ranks, rehearsed on meta in a process of its
own, with each phase's traffic and output reported beside the step's totals."""

import pytest

from tests.rehearsal.helpers import rehearse_one


def _rehearse_rl(tmp_path, export: str, *sets: str) -> dict:
    return rehearse_one(tmp_path, "--config", "configs/rehearsal/qwen3-30b-a3b.yaml", "--world", "8", "--rank", "3",
                        "--tokens", "4096", "--gpu", "h100", "--rl", export, sets=("model.num_layers=2", *sets))


@pytest.mark.slow
def test_an_rl_step_of_a_shrunk_qwen3_30b_a3b_rank_runs_every_phase(tmp_path):
    r = _rehearse_rl(tmp_path, "buckets")
    logprobs, update, export = (r["phases"][p] for p in ("logprobs", "update", "export buckets"))
    assert r["peak_split"]["parameters"] == 4 * r["params"]  # float32 masters
    assert r["peak_split"]["optimizer state"] > 0 and r["peak_split"]["activations"] > 0 and r["fits"]
    # the loss picks its tokens on the host: no device value is read back per micro-batch for it
    assert not [k for k in r["host_reads"] if "rl_hooks/objective.py" in k], r["host_reads"]
    # scoring: the whole batch of 8 alike ranks' rollouts, a forward's dispatch and combine per MoE layer
    assert logprobs["tokens"] == 8 * 4096
    assert logprobs["traffic"]["ep[0..7] all_to_all"]["calls"] == 2 * 2
    assert "dp_cp[0..7] reduce_scatter" not in logprobs["traffic"]  # no gradients
    # the update: loss on the responses only, gradients reduced, one optimizer step more than the warm-up's
    assert 0.7 * 8 * 4096 < update["loss_tokens"] < 0.8 * 8 * 4096  # the whole batch: 3/4 are responses
    assert update["optimizer_steps"] == 2
    assert update["traffic"]["dp_cp[0..7] reduce_scatter"]["payload_bytes"] > 0
    # the export gathers the experts over EP: bf16 bytes of the whole model come out on every rank
    assert export["traffic"]["ep[0..7] all_gather"]["payload_bytes"] > 0
    assert export["bytes"] > 2 * r["params"]
    total = r["traffic"]["ep[0..7] all_gather"]["payload_bytes"]
    assert total >= export["traffic"]["ep[0..7] all_gather"]["payload_bytes"]  # the step's totals hold it
    assert r["traffic"]["ep[0..7] all_to_all"]["calls"] == (logprobs["traffic"]["ep[0..7] all_to_all"]["calls"]
                                                           + update["traffic"]["ep[0..7] all_to_all"]["calls"])


@pytest.mark.slow
def test_the_shard_export_moves_nothing_and_yields_about_a_rank_s_share(tmp_path):
    """With the parameters in bf16 (train.param_dtype, what a colocated RL run picks for room)."""
    r = _rehearse_rl(tmp_path, "shards", "train.param_dtype=bf16")
    # the matrices in bf16; the embedding, norms and router stay float32 (precision.py)
    assert 2 * r["params"] < r["peak_split"]["parameters"] < 3 * r["params"]
    export = r["phases"]["export shards"]
    assert export["traffic"] == {} and export["pieces"] > 0
    # each element once over the 8 ranks: about the model's bf16 bytes / 8, this rank's params or fewer
    assert 0 < export["bytes"] <= 2 * r["params"]
    assert r["phases"]["update"]["optimizer_steps"] == 2
    # colocated: after offload() the rank holds <= 2% of its device bytes
    offload = r["phases"]["offload"]
    assert offload["offload_residual_frac"] <= 0.02 and offload["host_bytes"] >= 0.98 * offload["device_bytes_before"]
