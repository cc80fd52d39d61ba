"""Faults planted inside a rehearsed training step (rehearsal/faults.py) of a shrunk Qwen3-30B-A3B
on 8 ranks: each is one a GPU job fails on and torch's fake process group lets through, and the
rehearsal refuses each in one line naming the rank, the op and the program's line."""

import pytest

from longctx_moe.config import load_config
from longctx_moe.rehearsal.faults import PLANTS, rehearse_planted
from longctx_moe.rehearsal.gpus import GPUS

_SETS = ["model.num_layers=1", "model.num_experts=16", "model.vocab_size=4096", "data.micro_batch_tokens=1024",
         "data.global_batch_tokens=8192"]


@pytest.mark.slow
def test_each_planted_fault_fails_the_rehearsal_in_one_line():
    cfg = load_config("configs/rehearsal/qwen3-30b-a3b.yaml", _SETS)
    lengths = [600, 300, 124]
    got = {plant: rehearse_planted(cfg, 8, [0, 3], plant, GPUS["h100"], lengths) for plant in PLANTS}
    host, mixed, dtype = got.values()
    # each names the program's line that issued the op (the plant itself is not the program)
    assert host.startswith("rank 0: c10d.allreduce_.default at parallel/grad_reduce.py:"), host
    assert "sends host tensors" in host
    assert mixed.startswith("rank 0: aten.add.Tensor at model/") and "mixes a host tensor" in mixed, mixed
    # rank 0 ran unplanted and passed: the rehearsal does not refuse a sound step
    assert dtype.startswith("rank 3: call ") and "torch.float32 where rank 0 runs" in dtype, dtype
    assert all("\n" not in line for line in got.values())
