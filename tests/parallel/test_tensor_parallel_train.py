"""Hierarchical CP through the real Trainer on world 8: TP2 x CP4 (all-to-all 2 x ring 2), and
CP8 split 4 x 2 and 2 x 4 (inner all-to-all x outer ring), the last with the distributed optimizer
(dense AdamW state in 8 slabs).

A few optimizer steps of the Trainer (float64, seq or switch aux loss, z-loss, expert bias,
gradient clipping) on the parallelized model track the single-process run step by step: the TP
layout with sequence parallelism and full recompute, the CP8 splits without. Every rank of the group holds
the same micro-batches (DP = 1). Tolerance as in test_train_parallel: float64, only the order of
the sums differs (measured agreement ~1e-12); 1e-6 leaves room for the optimizer's amplification.
"""

from __future__ import annotations

import pytest
import torch

from data_packing.batch import pad_multiple
from longctx_moe.config import load_config
from longctx_moe.parallel.dims import ParallelDims
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch
from tests.parallel.test_train_parallel import DOCS, SETS, _train, assert_tracks

STEPS = 3
TOL = 1e-6
HIER = ["parallel.tp=2", "parallel.cp=4", "parallel.cp_backend=hierarchical",
        "parallel.hierarchical_sizes=[2, 2]"]
WORLD8 = [HIER + ["parallel.ep=4", "parallel.sequence_parallel=true", "train.recompute=full",
                  "balance.aux_loss_type=seq"],
          ["parallel.cp=8", "parallel.cp_backend=hierarchical", "parallel.hierarchical_sizes=[4, 2]",
           "parallel.ep=4", "balance.aux_loss_type=seq"],
          ["parallel.cp=8", "parallel.cp_backend=hierarchical", "parallel.hierarchical_sizes=[2, 4]",
           "parallel.ep=2", "parallel.distributed_optimizer=true", "balance.aux_loss_type=switch"]]


def _steps(sets):
    """STEPS lists of 4 micro-batches, padded as the trainer's loader pads for the layout."""
    p = load_config(None, sets).parallel
    pad = pad_multiple(p.cp, p.tp, p.sequence_parallel)
    gen = torch.Generator().manual_seed(11)
    return [[packed_batch(d, 64, pad_multiple=pad, generator=gen) for d in DOCS]
            for _ in range(STEPS)]


def _rank(rank, world):
    out = []
    for sets in WORLD8:
        cfg = load_config(None, SETS + sets)
        dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
        dims.build_groups(rank)
        out.append(_train(sets, dims, _steps(sets)))
    return out


@pytest.mark.slow
def test_hierarchical_cp_with_tp2_and_4x2_2x4_splits_tracks_single_process_float64():
    got = run_distributed(_rank, 8, timeout=900)
    for i, sets in enumerate(WORLD8):
        assert_tracks(sets, [r[i] for r in got], _train(sets, None, _steps(sets)))
