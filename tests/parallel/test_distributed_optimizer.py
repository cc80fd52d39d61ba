"""The distributed optimizer (parallel.distributed_optimizer) against the replicated AdamW on the
same gloo ranks, float64, 5 trainer steps.

What may differ: the order of summation. A reduce-scatter and an all-reduce over the same ranks
add the same terms (gloo may pair them differently: ~1e-16 relative per element), and the global
norm for clipping is summed from slabs instead of whole tensors. AdamW is elementwise, so the
update of each element is the same function of the same inputs. 5 steps at lr 1e-2 with
clipping active keep the runs within 1e-10 of each other: the warmup step, then four at the full
rate, each reading back the moments the sharded optimizer kept per slab (a slab mapped to the
wrong elements, a missed bias correction or clip differs from the second step on, by far more).

Layouts: dense parameters replicated over dp_cp = 4, experts over edp = 4 (cp2 x dp2, ep1) and
edp = 2 (dp4, ep2); a vocabulary of 66 rows does not split 4 ways, so the embedding and LM head
are split along their 32 columns (strided slabs, foreach AdamW), or with optim.impl=fused along
their rows unevenly (17 / 17 / 16 / 16).
"""

from __future__ import annotations

import pytest
import torch

from longctx_moe.build import model_of
from longctx_moe.config import load_config
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.distributed_optimizer import (
    DistributedOptimizer,
    ShardedBucket,
    make_slab,
    slab_dim,
    split_sizes,
)
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import CrossEntropy, Trainer
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch

STEPS = 5
TOL = 1e-10
SETS = ["train.param_dtype=fp64", "train.autocast_dtype=none", "optim.warmup_steps=1", "optim.lr=1e-2",
        "optim.grad_clip=0.5", "optim.weight_decay=0.1", "model.vocab_size=66", "model.hidden_size=32",
        "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
        "model.num_experts=4", "model.expert_hidden_size=16", "model.first_k_dense=1",
        "model.dense_hidden_size=32", "model.shared_expert_hidden_size=16", "balance.aux_loss_type=switch",
        "balance.z_loss_coeff=0.01", "model.expert_bias=true", "parallel.grad_bucket_mb=0.004"]
LAYOUTS = [["parallel.cp=2"], ["parallel.ep=2"], ["parallel.ep=2", "optim.impl=fused"]]


def _trainer(rank, world, sets):
    cfg = load_config(None, [*SETS, *sets])
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
    dims.build_groups(rank)
    torch.manual_seed(0)
    return Trainer(cfg, parallelize(model_of(cfg).to(torch.float64), dims, cfg.parallel))


def _batches(trainer, step):
    """This DP replica's two micro-batches of `step`: documents of 1 to 20 tokens."""
    dims = trainer.dims
    gen = torch.Generator().manual_seed(1000 * step + dims.rank_in("dp"))
    docs = [[int(n) for n in torch.randint(1, 20, (3,), generator=gen)] for _ in range(2)]
    return [packed_batch(d, 66, pad_multiple=2 * dims.cp, generator=gen) for d in docs]


def _gradients(trainer, step):
    """{name: the whole reduced gradient} of one more step's micro-batches (no update)."""
    runtime = trainer.runtime
    batches = _batches(trainer, step)
    g = trainer.step_totals(batches, [None] * len(batches), [mb.num_target_tokens() for mb in batches])[0]
    for i, mb in enumerate(batches):
        shard = runtime.shard(mb)
        out = runtime.forward(shard)
        if i == len(batches) - 1:
            runtime.start_gradient_reduction()
        (CrossEntropy().micro_loss(i, out, shard, g).loss + (out.aux_loss + out.z_loss) * (shard.num_targets / g)).backward()
    runtime.reduce_gradients()
    opt = trainer.optimizer
    full = opt.gather_grads() if isinstance(opt, DistributedOptimizer) else {id(p): p.grad for p in trainer.model.parameters()}
    return {n: full[id(p)].clone() for n, p in trainer.model.named_parameters()}


def _optimizer_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor) and v.ndim > 0)


def _run(rank, world, sets):
    out = {}
    for sharded in (False, True):
        trainer = _trainer(rank, world, [*sets, f"parallel.distributed_optimizer={str(sharded).lower()}"])
        losses = [trainer.train_step(_batches(trainer, s)).loss for s in range(STEPS)]
        out[sharded] = (losses, _gradients(trainer, STEPS),
                        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                        _optimizer_bytes(trainer.optimizer), trainer)
    (l0, g0, p0, b0, _), (l1, g1, p1, b1, t1) = out[False], out[True]
    for a, b in zip(l0, l1, strict=True):
        assert abs(a - b) <= TOL * abs(a), (sets, l0, l1)
    for name in p0:
        assert (p0[name] - p1[name]).abs().max().item() < TOL, (sets, "param", name)
        assert (g0[name] - g1[name]).abs().max().item() < TOL, (sets, "grad", name)
    # Per-rank optimizer state: each parameter's exp_avg / exp_avg_sq cover its slab only.
    expected = 0
    for slab in t1.optimizer.slabs:
        expected += 2 * slab.param.element_size() * slab.param.numel() // slab.param.shape[slab.dim] * slab.sizes[slab.rank]
    expected += sum(2 * p.numel() * p.element_size() for p in t1.optimizer.whole)
    assert b1 == expected, (b1, expected)
    return b0, b1, [(s.dim, s.sizes) for s in t1.optimizer.slabs if "embed" in _name(t1, s.param)]


def _name(trainer, param):
    return next(n for n, p in trainer.model.named_parameters() if p is param)


def _check(rank, world):
    return [_run(rank, world, sets) for sets in LAYOUTS]


@pytest.mark.multirank
def test_distributed_optimizer_equals_replicated_after_5_steps_float64():
    results = run_distributed(_check, world_size=4, timeout=900)
    for rank_result in results:
        (b0, b1, embed), (c0, c1, embed_ep), (f0, f1, embed_fused) = rank_result
        # cp2 x dp2, ep1: every parameter has 4 replicas (dense over dp_cp, experts over edp)
        assert b1 * 4 == b0, (b0, b1)
        # dp4 x ep2: dense 4 replicas, experts 2: between 1/4 and 1/2 of the replicated bytes
        assert c0 / 4 < c1 < c0 / 2, (c0, c1)
        assert embed == [(1, [8, 8, 8, 8])]  # 66 rows do not split 4 ways; 32 columns do
        assert embed_fused == [(0, [17, 17, 16, 16])]  # fused AdamW needs contiguous slabs


def test_slab_dims_and_zero_dim_refusal():
    assert slab_dim((8, 3), 4, False) == 0
    assert slab_dim((6, 8), 4, False) == 1
    assert slab_dim((6, 7), 4, False) == 0
    assert slab_dim((6, 8), 4, True) == 0
    slab = make_slab(torch.nn.Parameter(torch.arange(12.0).view(6, 2)), 3, 4, False)
    assert slab.sizes == [2, 2, 1, 1] and slab.start == 5
    assert torch.equal(slab.data, torch.tensor([[10.0, 11.0]]))
    slab.data.add_(1)  # a view: updating the slab updates the weight
    assert slab.param[5, 0].item() == 11.0
    with pytest.raises(ValueError, match="0-dim parameter"):
        make_slab(torch.nn.Parameter(torch.tensor(1.0)), 0, 2, False)


def test_slab_sizes_and_runs_are_tensor_split_s_and_the_rows_of_one_stride():
    """The slab layout computed from closed forms (as it must be for groups of a thousand ranks)
    is the one tensor_split and a part-by-part walk give. Fails if the longer parts are put last,
    or if a run spans parts of another size or another start."""
    for n, parts in [(66, 4), (7, 8), (1024, 1024), (4099, 1024), (3, 1)]:
        assert split_sizes(n, parts) == [len(r) for r in torch.arange(n).tensor_split(parts)], (n, parts)
    for shapes, parts in [([(66, 32), (17, 3), (8,)], 4), ([(1030, 5), (2050,), (7, 3)], 1024), ([(4, 4)], 4)]:
        slabs = [make_slab(torch.nn.Parameter(torch.empty(s, device="meta")), 0, parts, True) for s in shapes]
        numel = [[s.numel(j) for s in slabs] for j in range(parts)]
        starts = [[sum(row[:i]) for i in range(len(slabs))] for row in numel]
        for i, slab in enumerate(slabs):
            walked, offset = [], 0  # a new run wherever the start in the row or the size changes
            for j in range(parts):
                if walked and (starts[j][i], slab.sizes[j]) == (starts[j - 1][i], slab.sizes[j - 1]):
                    walked[-1][1] += 1
                else:
                    walked.append([j, 1, offset])
                offset += slab.sizes[j]
            starts_R = torch.tensor([row[i] for row in starts]).numpy()
            got = ShardedBucket._runs_of(starts_R, torch.tensor(slab.sizes).numpy())
            assert got == [tuple(r) for r in walked], (shapes[i], parts)
