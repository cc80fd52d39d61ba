"""The parallel runtime on one process: every setting the config accepts takes effect.

`parallelize` runs on one rank too (train.py always calls it): the dispatcher it installs applies
the capacity factor and drop policy there, and layouts the runtime cannot honour are refused at
start-up with one line. Multi-rank exactness lives in test_parallelize.py and
test_train_parallel.py; the loss of the same batch is compared here in float64.
"""

from __future__ import annotations

import pytest
import torch

from longctx_moe.config import load_config
from longctx_moe.model import build_model
from longctx_moe.model.moe import LocalDispatcher
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.context_parallel import CPGroup
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.dispatch import AllToAllDispatcher
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.parallel.runtime import NO_CP
from tests.model.helpers import packed_batch, tiny_config


def _loss(cfg: ParallelConfig) -> float:
    torch.manual_seed(0)
    runtime = parallelize(build_model(tiny_config(num_experts=4, top_k=2)).double(), None, cfg)
    batch = packed_batch([17, 5, 30], 64, generator=torch.Generator().manual_seed(1))
    shard = runtime.shard(batch)
    assert shard.cp is NO_CP and shard.batch is batch
    return float(runtime.forward(shard).ce_sum.detach())


def test_one_rank_dropless_keeps_the_local_dispatcher():
    runtime = parallelize(build_model(tiny_config()).double())
    assert all(isinstance(m.dispatcher, LocalDispatcher) for m in runtime.model.moe_layers())


def test_one_rank_capacity_and_drop_policy_take_effect():
    dropless = _loss(ParallelConfig())
    # A capacity this small drops assignments: the loss moves, and the two policies drop
    # different ones (probs keeps the heaviest, position the earliest).
    by_probs = _loss(ParallelConfig(capacity_factor=0.25, drop_policy="probs"))
    by_position = _loss(ParallelConfig(capacity_factor=0.25, drop_policy="position"))
    assert len({dropless, by_probs, by_position}) == 3
    # A capacity no expert reaches keeps every assignment: dropless again (float64, same sums
    # in another order; 1e-12 is far above its rounding).
    assert abs(_loss(ParallelConfig(capacity_factor=64.0)) - dropless) < 1e-12
    runtime = parallelize(build_model(tiny_config()).double(), None,
                          ParallelConfig(capacity_factor=0.25, drop_policy="position"))
    d = runtime.model.moe_layers()[0].dispatcher
    assert isinstance(d, AllToAllDispatcher) and (d.capacity_factor, d.drop_policy) == (0.25, "position")


@pytest.mark.parametrize("sets, needle", [
    (["parallel.etp=2", "model.expert_hidden_size=9"], "not divisible by etp=2"),
])
def test_unsupported_layouts_are_refused_at_start_up_in_one_line(sets, needle):
    from longctx_moe.build import build_runtime

    cfg = load_config(None, ["model.num_experts=4", "model.top_k=2", *sets])
    # ValueError from the mesh's checks (build.build_dims turns it into a ConfigError), or a
    # ConfigError from build_runtime; either way before any process group is needed.
    with pytest.raises(ValueError) as e:
        dims = ParallelDims.from_config(cfg.parallel, 2, cfg.model)
        dims.rank = 0
        build_runtime(cfg, dims, torch.device("cpu"))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_one_rank_cp_group_carries_no_group():
    # The stats reducer and the executors read group None as "one rank": a one-rank CPGroup
    # holding a real group would send collectives to nobody's benefit, so it is refused.
    assert NO_CP.group is None
    with pytest.raises(ValueError, match=r"one-rank CPGroup takes group=None \(use NO_CP\)"):
        CPGroup(size=1, rank=0, group=object())
