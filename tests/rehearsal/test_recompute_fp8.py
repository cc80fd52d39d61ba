"""Activation recompute and FP8 in the cluster rehearsal (`longctx-moe rehearse`): the shrunk
models' steps run with train.recompute=selective / full, whose recomputation in the backward must
see the forward's autocast casts (meta_autocast) and take the forward's path, and with
execution.fp8 on a Hopper GPU, whose expert GEMMs read no routing count of their own. Each
rehearsal runs in a process of its own."""

import pytest

from tests.rehearsal.helpers import rehearse_one

QWEN = "configs/rehearsal/qwen3-30b-a3b.yaml"


def _rehearse(tmp_path, config: str, world: int, rank: int, *sets: str) -> dict:
    return rehearse_one(tmp_path, "--config", config, "--world", str(world), "--rank", str(rank), "--tokens",
                        "4096", "--gpu", "h100", sets=("model.num_layers=2", *sets))


def test_fp8_is_resolved_for_the_rehearsed_gpu():
    """execution.fp8's start-up checks ask torch.cuda for the device's compute capability, which a
    CUDA-less torch cannot answer: the rehearsal answers the rehearsed GPU's. Hopper runs the block
    recipe; Blackwell is refused it in the program's own words."""
    from longctx_moe.config import load_config
    from longctx_moe.rehearsal.fake_world import cuda_ops
    from longctx_moe.rehearsal.gpus import GPUS, as_cuda_device

    cfg = load_config(QWEN, ["execution.fp8=torch", "execution.fp8_recipe=block"])
    with as_cuda_device(GPUS["h100"]):
        ops = cuda_ops(cfg)
    assert (ops.fp8, ops.fp8_recipe) == ("torch", "block")
    with as_cuda_device(GPUS["b200"]), pytest.raises(ValueError, match="runs on Hopper"):
        cuda_ops(cfg)


@pytest.mark.slow
def test_fp8_block_experts_rehearse_on_8_ranks_with_no_host_read_of_their_own(tmp_path):
    """The shrunk Qwen3-30B-A3B (its config: EP8, full recompute) with execution.fp8=torch in
    1 x 128 / 128 x 128 blocks on an H100, the tokens dispatched in the experts' own FP8 tiles.
    The FP8 expert GEMMs loop by the rows per expert the dispatcher read through the routing
    seam: the host reads are the step's own and the seam's, once per MoE layer and forward (the
    full recompute's replay included)."""
    r = _rehearse(tmp_path, QWEN, 8, 3, "execution.fp8=torch", "execution.fp8_recipe=block",
                  "parallel.dispatch_dtype=fp8")
    assert r["fits"] and r["roles"]["ep"] == 3
    reads = r["host_reads"]
    assert all(any(a in where for a in ("trainer.py", "(global_norm)", "RoutingCounts.read")) for where in reads), reads
    assert reads["routing counts (parallel/comm.py RoutingCounts.read)"] == 2 * 2  # 2 layers, forward and replay
    sent = [dtype for op, dtype, _ in r["calls"]["ep[0..7]"] if op == "all_to_all"]
    assert sent.count("torch.uint8") == 2 * 2  # the tokens' FP8 wire form, each forward of each layer
