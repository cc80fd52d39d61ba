"""bench/memory.py's bf16_params section, its full-size half: `bf16_param_bytes_ratio` is the
rehearsal's parameter bytes with train.param_dtype=bf16 over fp32, read from two `longctx-moe
rehearse` runs. Here on the 2-layer shrink of its Qwen3-30B-A3B rank (the full size takes ~2
CPU-minutes a run)."""

from __future__ import annotations

import pytest

from bench import memory

pytestmark = pytest.mark.slow


def test_the_rehearsed_ratio_is_bf16_parameters_over_fp32(monkeypatch):
    monkeypatch.setattr(memory, "PARAM_REHEARSAL", [*memory.PARAM_REHEARSAL, "--set", "model.num_layers=2"])
    got = memory._rehearsed_params()
    fp32, bf16 = got["fp32"], got["bf16"]
    assert got["ratio"] == bf16["param_bytes"] / fp32["param_bytes"]
    # rank 0 of EP8, 2 layers: 812M elements, of which the embedding's 311M (151,936 x 2,048) and
    # the routers and norms stay fp32 and the rest (attention, 16 experts' matrices, the output
    # head) goes to bf16: (2 x 500 + 4 x 312) / (4 x 812) = 0.69 (at the full 48 layers 0.53)
    assert 0.68 < got["ratio"] < 0.70, got
    # the masters of the bf16 matrices join AdamW's moments in the optimizer: 4 bytes an element
    # on top of 8 there, for the bf16 part, sharded over the 8 replicas where dense
    assert bf16["optimizer_state_bytes"] > fp32["optimizer_state_bytes"]
