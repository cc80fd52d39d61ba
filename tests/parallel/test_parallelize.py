"""parallelize (TP + CP + EP + DP) on the real Transformer: 4 gloo ranks against one process,
float64, with the seq or switch aux loss, the router z-loss and a (random) expert bias on.

Each DP replica runs its own packed micro-batch (TP peers share it); the reference runs all of
them with the unsharded model. After the reductions the trainer does (dense over dp_cp or their
reduce_axis, experts over edp, summed: the loss is a sum over replicas), every gradient (the
rank's shard of it) and the clipped global norm equal the reference within 1e-10 (float64;
only the summation order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.model import build_model
from longctx_moe.model.config import BalanceConfig
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.grad_reduce import clip_grad_norm, split_params
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.parallel.sharding import split_dim
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config
from tests.parallel._moe_ref import concat_batches

TOL = 1e-10
# per DP replica: a length-1 document, one long document spanning every CP rank, short ones
DOCS = [[5, 9, 1, 33], [1, 7, 3], [12, 2], [2, 2, 6]]
LAYOUTS = [dict(ep=2), dict(ep=4, dispatcher="allgather"), dict(tp=2), dict(tp=2, ep=4),
           dict(tp=2, ep=2, dispatcher="allgather"),
           # CP: hierarchical CP4 (2x2) with EP2 EDP2, ring x TP, Ulysses x DP
           dict(cp=4, ep=2, cp_backend="hierarchical", hierarchical_sizes=[2, 2]),
           dict(cp=2, tp=2, ep=4), dict(cp=2, ep=2, cp_backend="ulysses"),
           dict(cp=4, ep=2, cp_backend="hierarchical", hierarchical_sizes=[2, 2]),
           # Megatron's global-batch aux loss (switch): statistics over every replica's tokens
           dict(ep=4, aux_loss_scope="global_batch", aux="switch"),
           dict(cp=2, ep=2, aux_loss_scope="global_batch", aux="switch"),
           # expert lending: the bias sends every token to experts 0 and 1 (EP ranks 0, 1 of 4),
           # which lend rows to ranks 2 and 3
           dict(cp=2, tp=2, ep=4, ep_spare_slots=2, skew=True)]
AUX = ("seq", "switch")  # layout i runs AUX[i % 2] unless it names aux: layouts 5 and 8 run both
COLUMN_SHARDED = ("wo.weight", "w_down.weight")  # row-parallel layers keep input columns


def _loss(out, n, g):
    """The trainer's per-micro-batch loss: ce_sum / G + (aux + z) * n / G (trainer.py)."""
    return out.ce_sum / g + (out.aux_loss + out.z_loss) * (n / g)


def _model(seed, aux="seq", skew=False):
    torch.manual_seed(seed)
    # first layer dense and a shared expert: both dense-MLP kinds get TP-sharded.
    cfg = tiny_config(num_experts=4, top_k=2, first_k_dense=1, shared_expert_hidden_size=16, expert_bias=True)
    balance = BalanceConfig(aux_loss_type=aux, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    model = build_model(cfg, balance=balance).double()
    for layer in model.moe_layers():  # a non-zero bias changes the selection: exercise it
        layer.router.expert_bias.copy_(0.05 * torch.randn(cfg.num_experts))
        if skew:  # scores are below 1: experts 0 and 1 win every token's selection
            layer.router.expert_bias.copy_(torch.tensor([1.0, 1.0, 0.0, 0.0]))
    return model


def _expected_grad(name, p, want, dims):
    """This rank's piece of the reference gradient `want` for parameter `p`."""
    if split_dim(p, "tp") is not None:
        dim = 1 if name.endswith(COLUMN_SHARDED) else 0
        n = p.shape[dim]
        return want.narrow(dim, dims.rank_in("tp") * n, n)
    if p.shape != want.shape:  # an expert weight: this rank's slice of dim 0
        n = p.shape[0]
        return want[dims.rank_in("ep") * n:(dims.rank_in("ep") + 1) * n]
    return want


def _check_layout(rank, world, kw, seed, aux="seq", skew=False):
    dims = ParallelDims.from_config(ParallelConfig(**kw), world, tiny_config(), BalanceConfig(aux_loss_type=aux))
    dims.build_groups(rank)
    gen = torch.Generator().manual_seed(seed)
    # slots padded to 2*CP (zigzag halves) and TP, as the trainer's loader does
    pad = 2 * dims.cp * dims.tp
    batches = [packed_batch(d, 64, pad_multiple=pad, generator=gen) for d in DOCS[:dims.dp]]
    g = sum(b.num_target_tokens() for b in batches)  # G of the trainer: one micro-batch each
    # global_batch: the reference is one forward over the whole batch (one balance statistic)
    ref_batches = [concat_batches(batches)] if kw.get("aux_loss_scope") == "global_batch" else batches
    ref = _model(seed, aux, skew)
    ref_out = [ref(b) for b in ref_batches]
    ref_loss = sum(_loss(o, b.num_target_tokens(), g) for o, b in zip(ref_out, ref_batches,
                                                                       strict=True))
    ref_loss.backward()
    runtime = parallelize(_model(seed, aux, skew), dims)
    model = runtime.model
    for layer in model.moe_layers() if skew else ():  # tiny batches: lend however few rows
        layer.dispatcher.min_lend_rows = 1
    mine = batches[dims.rank_in("dp")]
    out = runtime.forward(runtime.shard(mine))
    if skew:  # the plan really lent: each of the 4 EP ranks ran about a quarter of the rows
        rows = [layer.dispatcher.rank_rows for layer in model.moe_layers()]
        assert all(max(r) - min(r) <= 1 for r in rows), rows
    loss, counts = _loss(out, mine.num_target_tokens(), g), out.expert_counts.clone()
    loss.backward()
    dense, expert = split_params(model)
    assert expert and not set(map(id, dense)) & set(map(id, expert))
    runtime.reduce_gradients()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dims.group("dp_cp"))  # TP peers hold the same loss
    assert abs(total.item() - ref_loss.item()) < TOL, kw
    # expert-bias load: summed over the data-parallel ranks, it is the whole batch's
    dist.all_reduce(counts, group=dims.group("dp_cp"))
    assert torch.equal(counts, sum(o.expert_counts for o in ref_out)), kw
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = _expected_grad(name, p, ref_params[name].grad, dims)
        assert (p.grad - want).abs().max().item() < TOL, (kw, name)
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), float("inf"))
    assert abs(float(clip_grad_norm(dense, expert, dims, 0.0)) - float(ref_norm)) < TOL, kw
    assert abs(runtime.clip_grad_norm(0.0) - float(ref_norm)) < TOL, kw


def _check_all(rank, world):
    for seed, kw in enumerate(LAYOUTS):
        kw = dict(kw)
        _check_layout(rank, world, kw, seed, kw.pop("aux", AUX[seed % 2]), kw.pop("skew", False))
    # A CP layout describes one rank's shard: the full batch with it is refused, not wrong.
    dims = ParallelDims.from_config(ParallelConfig(cp=2), world, tiny_config())
    dims.build_groups(rank)
    runtime = parallelize(_model(0), dims)
    full = packed_batch([8], 64, pad_multiple=4)
    with pytest.raises(ValueError, match="run the model on the shard"):
        runtime.model.logits(full, runtime.shard(full).layout)
    return True


@pytest.mark.slow
def test_expert_parallel_model_matches_single_process_float64():
    assert run_distributed(_check_all, world_size=4, timeout=300) == [True] * 4


def _check_world8(rank, world):
    for seed, aux in enumerate(AUX):
        _check_layout(rank, world, dict(tp=2, cp=2, ep=4), seed, aux)
    return True


@pytest.mark.slow
def test_world8_tp2_cp2_dp2_ep4_model_matches_single_process_float64():
    # Attention TP2 x CP2 x DP2 and MoE EP4 x EDP2 folded over the same 8 ranks.
    assert run_distributed(_check_world8, world_size=8, timeout=600) == [True] * 8
