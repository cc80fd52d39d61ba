"""parallel/sharding.py: the splits the parallelizers declare on parameters give each one's global
shape and this rank's offsets, which the checkpoint reads (checkpoint/sharded_state.py)."""

import pytest
import torch

from longctx_moe.checkpoint.sharded_state import global_slices
from longctx_moe.config import load_config
from longctx_moe.model import build_model
from longctx_moe.parallel.expert_parallel import shard_expert_hidden, shard_experts
from longctx_moe.parallel.sharding import declare_split, global_slice, split_dim, splits_of
from longctx_moe.parallel.tensor_parallel import shard_swiglu


def test_a_declared_split_gives_global_shape_and_offsets():
    p = torch.nn.Parameter(torch.zeros(4, 6))
    assert global_slice(p) == ((4, 6), (0, 0)) and splits_of(p) == ()
    declare_split(p, "tp", 1, 3, 2)
    declare_split(p, "ep", 0, 2, 1)
    assert global_slice(p) == ((8, 18), (4, 12))
    assert split_dim(p, "tp") == 1 and split_dim(p, "etp") is None


def test_a_second_split_over_the_same_axis_or_dim_is_refused():
    p = torch.nn.Parameter(torch.zeros(4, 6))
    declare_split(p, "tp", 0, 2, 0)
    with pytest.raises(ValueError, match="already split"):
        declare_split(p, "tp", 1, 2, 0)
    with pytest.raises(ValueError, match="already split"):
        declare_split(p, "ep", 0, 2, 0)
    with pytest.raises(ValueError, match="does not exist"):
        declare_split(torch.nn.Parameter(torch.zeros(2)), "tp", 0, 2, 2)


def test_expert_weights_keep_their_ep_split_when_etp_cuts_them_again():
    cfg = load_config(None, ["model.num_experts=4", "model.expert_hidden_size=8"]).model
    experts = build_model(cfg).layers[-1].ffn.experts
    E, D, F = 4, cfg.hidden_size, 8
    shard_experts(experts, 1, 2)
    shard_expert_hidden(experts, 1, 2)
    assert global_slice(experts.w_down) == ((E, F, D), (2, 4, 0))
    assert global_slice(experts.w_gate_up) == ((E, D, 2, F), (2, 0, 0, 4))


def test_checkpoint_slices_of_tp_sharded_dense_and_shared_mlps_have_their_own_widths():
    cfg = load_config(None, ["model.shared_expert_hidden_size=96", "model.dense_hidden_size=64",
                             "model.first_k_dense=1"]).model
    model = build_model(cfg)
    shard_swiglu(model.layers[0].ffn, 1, 2, None)  # TP rank 1 of 2 (no forward: no group needed)
    shard_swiglu(model.layers[1].ffn.shared, 1, 2, None)
    slices = global_slices(model)
    D = cfg.hidden_size
    assert slices["layers.0.ffn.w_gate.weight"] == ((64, D), (32, 0))
    assert slices["layers.1.ffn.shared.w_gate.weight"] == ((96, D), (48, 0))
    assert slices["layers.1.ffn.shared.w_down.weight"] == ((D, 96), (0, 48))
    assert slices["norm.weight"] == ((D,), (0,))
