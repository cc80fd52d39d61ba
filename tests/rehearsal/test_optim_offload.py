"""optim.offload=cpu in the rehearsal: rank 3 of the shrunk Qwen3-30B-A3B (2 layers) on 8 ranks
holds no optimizer state on its device; the host holds it (the rehearsal's fake host memory,
rehearsal/host_memory.py), and the device's peak falls by exactly what left it."""

import pytest

from tests.rehearsal.helpers import rehearse_one

ARGS = ("--config", "configs/rehearsal/qwen3-30b-a3b.yaml", "--world", "8", "--rank", "3", "--tokens", "4096")


@pytest.fixture(scope="module")
def on_device(tmp_path_factory) -> dict:
    """The rehearsal with today's defaults (fp32 parameters, AdamW on the device): both tests'
    reference, run once."""
    return rehearse_one(tmp_path_factory.mktemp("on-device"), *ARGS, sets=("model.num_layers=2",))


@pytest.mark.slow
def test_the_device_holds_no_optimizer_state_with_optim_offload_cpu(tmp_path, on_device):
    offloaded = rehearse_one(tmp_path, *ARGS, sets=("model.num_layers=2", "optim.offload=cpu"))
    moved = on_device["peak_split"]["optimizer state"]
    assert moved > 0 and offloaded["peak_split"]["optimizer state"] == 0
    # the step peaks in the same place (the forward), without the moments
    assert offloaded["peak_bytes"] == on_device["peak_bytes"] - moved
    # AdamW's moments and the masters on the host (its gradient buffers too)
    assert offloaded["host_bytes"] >= on_device["host_bytes"] + moved
    # the modeled step pays for the copies (cost.host_optimizer_seconds): the moments' 8 bytes an
    # element the host steps, the same 8 bytes cross PCIe (4 of fp32 gradient down, 4 of fp32
    # weight up) at the H100 node's 40 GB/s; and for the host's AdamW
    plain, offload = on_device["step_seconds"], offloaded["step_seconds"]
    assert plain["offload_s"] == 0 and offload["pcie_s"] == pytest.approx(moved / 40e9, rel=1e-3)
    assert offload["offload_s"] == offload["pcie_s"] + offload["host_adamw_s"] > offload["pcie_s"]


@pytest.mark.slow
def test_bf16_parameters_keep_fp32_masters_beside_the_moments(tmp_path, on_device):
    """train.param_dtype=bf16: the optimizer holds an fp32 master of each bf16 matrix beside
    AdamW's two fp32 moments, 12 bytes an element against 8; the embedding, norms and router stay
    fp32 and are their own masters (8). The masters are the inner optimizer's parameters, made
    before the step: the memory tracker is told of them (untold, the ratio is 1)."""
    fp32 = on_device
    bf16 = rehearse_one(tmp_path, *ARGS, sets=("model.num_layers=2", "train.param_dtype=bf16"))
    ratio = bf16["peak_split"]["optimizer state"] / fp32["peak_split"]["optimizer state"]
    # this 2-layer shrink: the fp32 embedding is about a sixth of its elements
    assert 1.35 < ratio < 1.5, ratio
