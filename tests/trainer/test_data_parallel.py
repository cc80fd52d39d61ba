"""Two data-parallel ranks (gloo) train exactly like one process on the same global batch."""

import pytest
import torch

from longctx_moe.build import model_of
from longctx_moe.config import load_config
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import Trainer
from tests.launcher import run_distributed
from tests.trainer.toy import make_batch

STEPS = 3
SETS = ["train.param_dtype=fp64", "train.autocast_dtype=none", "optim.warmup_steps=1", "optim.lr=1e-2",
        "optim.grad_clip=0.5", "model.vocab_size=64", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "model.num_experts=4",
        "model.expert_hidden_size=16", "model.first_k_dense=1", "model.dense_hidden_size=32",
        "balance.aux_loss_type=switch", "model.expert_bias=true"]


def global_steps():
    """STEPS optimizer steps of 4 micro-batches each; rank r of 2 takes micro-batches r and r+2.
    Uneven sizes (and one micro-batch of length-1 documents, no targets) test the global count."""
    gen = torch.Generator().manual_seed(7)
    docs = [[9, 3], [1, 1], [14], [5, 6, 2]]
    return [[make_batch(d, 64, gen) for d in docs] for _ in range(STEPS)]


def train(dims, steps_batches):
    cfg = load_config(None, SETS)
    torch.manual_seed(0)
    model = model_of(cfg).to(torch.float64)
    trainer = Trainer(cfg, parallelize(model, dims, cfg.parallel))
    losses = [trainer.train_step(b).loss for b in steps_batches]
    # numpy, not tensors: torch's queue shares tensor storage through a file descriptor that is
    # gone once the worker process exits.
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, losses


def _dp_rank(rank, world_size):
    cfg = load_config(None, SETS)
    dims = ParallelDims.from_config(cfg.parallel, world_size, cfg.model, cfg.balance)
    dims.build_groups(rank)
    r, n = dims.rank_in("dp"), dims.size("dp")
    local = [[mb for i, mb in enumerate(step) if i % n == r] for step in global_steps()]
    return train(dims, local)


@pytest.mark.slow
def test_two_dp_ranks_equal_single_process_float64():
    ref_state, ref_losses = train(None, global_steps())
    results = run_distributed(_dp_rank, 2, timeout=240)
    for state, losses in results:
        # float64: only the order of the gradient sums differs (~1e-16 relative per step).
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=0)
        for name, ref in ref_state.items():
            assert torch.allclose(torch.from_numpy(state[name]), torch.from_numpy(ref), rtol=1e-10, atol=1e-12), name
    moved = [k for k in ref_state if "expert_bias" in k]
    assert moved and any(abs(ref_state[k]).sum() > 0 for k in moved)  # the DP-summed counts were used
