"""Models with the pretrained-family attention features under TP and CP on 4 gloo ranks against
one process, float64: MLA (DeepSeek-V3: v head dim != q/k, low-rank q, YaRN) under ring and
Ulysses CP, gpt-oss attention (sinks, a sliding-window layer and a full one, an output bias added
once after the sum over TP) under Ulysses and under the ring (the window, 3 keys, is shorter than
the zigzag chunks of the longer documents and longer than the short ones). Loss and every gradient
(this rank's shard of it) within 1e-10 after the trainer's reductions (only the summation order
differs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.model import build_model
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.parallel.sharding import global_slice
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config

TOL = 1e-10
DOCS = [[5, 9, 1, 33], [1, 7, 3], [12, 2], [2, 2, 6]]  # per DP replica
YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 0.8}
FEATURES = {
    "mla": dict(attention_type="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                qk_rope_head_dim=4, v_head_dim=5, qk_norm=False, rope_scaling=YARN),
    "gpt_oss": dict(attention_sinks=True, sliding_window=3, qkv_bias=True, qk_norm=False,
                    attention_out_bias=True,  # added once, after the sum over TP
                    layer_types=["sliding_attention", "full_attention"]),
}
LAYOUTS = [("mla", dict(tp=2, cp=2)), ("mla", dict(cp=4, cp_backend="ulysses")),
           ("gpt_oss", dict(tp=2, cp=2, cp_backend="ulysses")), ("gpt_oss", dict(tp=2, cp=2))]


def _model(seed, features):
    torch.manual_seed(seed)
    return build_model(tiny_config(num_experts=4, top_k=2, **FEATURES[features])).double()


def _shard_of(p, want):
    """This rank's piece of the single-process tensor `want`: the split declared on `p`."""
    for dim, offset in enumerate(global_slice(p)[1]):
        want = want.narrow(dim, offset, p.shape[dim])
    return want


def _check_layout(rank, world, features, kw, seed):
    dims = ParallelDims.from_config(ParallelConfig(**kw), world, tiny_config())
    dims.build_groups(rank)
    gen = torch.Generator().manual_seed(seed)
    batches = [packed_batch(d, 64, pad_multiple=2 * dims.cp * dims.tp, generator=gen)
               for d in DOCS[:dims.dp]]
    g = sum(b.num_target_tokens() for b in batches)
    loss_of = lambda out, b: out.ce_sum / g + (out.aux_loss + out.z_loss) * (b.num_target_tokens() / g)
    ref = _model(seed, features)
    ref_loss = sum(loss_of(ref(b), b) for b in batches)
    ref_loss.backward()
    runtime = parallelize(_model(seed, features), dims)
    mine = batches[dims.rank_in("dp")]
    loss = loss_of(runtime.forward(runtime.shard(mine)), mine)
    loss.backward()
    runtime.reduce_gradients()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dims.group("dp_cp"))
    assert abs(total.item() - ref_loss.item()) < TOL, (features, kw)
    ref_params = dict(ref.named_parameters())
    for name, p in runtime.model.named_parameters():
        want = _shard_of(p, ref_params[name].grad)
        assert (p.grad - want).abs().max().item() < TOL, (features, kw, name)


def _check_all(rank, world):
    for seed, (features, kw) in enumerate(LAYOUTS):
        _check_layout(rank, world, features, kw, seed)
    return True


@pytest.mark.slow
def test_mla_and_gpt_oss_attention_under_tp_and_cp_match_single_process_float64():
    assert run_distributed(_check_all, world_size=4, timeout=500) == [True] * 4
