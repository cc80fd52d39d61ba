"""Weight export: buckets under the cap, every tensor once, an expert never split, the same tensors
gathered under EP2 x TP2 as on one process, and transformers' Qwen3-MoE loading them (from a
safetensors directory, as engines load a checkpoint) with the same logits as our model."""

from __future__ import annotations

import pytest
import torch

from rl_hooks import PolicyTrainer
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch
from tests.rl_hooks.helpers import config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# Qwen3-MoE expresses this model: no shared expert, softmax router, q/k-norm; one dense layer.
HF_SETS = ["model.shared_expert_hidden_size=0", "model.first_k_dense=1", "model.num_layers=3",
           "model.dense_hidden_size=32", "model.init_std=0.2", "train.param_dtype=fp32"]
CAP = 8192  # bytes: many buckets, while the largest unit (the 50 x 32 embedding, 6.4 KB) fits


def _export(policy, dtype=torch.float32):
    return [[(n, t.clone()) for n, t in bucket] for bucket in policy.export_weights(CAP, dtype)]


def test_buckets_hold_every_tensor_once_under_the_cap_and_keep_experts_whole():
    policy = PolicyTrainer(config(*HF_SETS))
    buckets = _export(policy)
    spec = policy.weights_spec(torch.float32)
    names = [n for b in buckets for n, _ in b]
    assert names == [s.name for s in spec] and len(set(names)) == len(names)
    assert len(buckets) > 3
    shapes = {s.name: s.shape for s in spec}
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= CAP
        assert all(tuple(t.shape) == shapes[n] and t.dtype == torch.float32 for n, t in bucket)
        experts = [n.rsplit(".", 2)[0] for n, _ in bucket if ".experts." in n]
        for e in set(experts):  # gate, up and down of one expert travel together
            assert experts.count(e) == 3, e
    sizes = []
    stats = policy.push_weights(sizes.append, CAP, torch.float32)
    assert stats["buckets"] == len(buckets) and stats["tensors"] == len(names)
    # a cap below the largest tensor: each unit over it travels alone, the rest fill up to it
    small = list(policy.export_weights(100, torch.float32))
    assert [n for b in small for n, _ in b] == names
    # (an expert's gate, up and down are one unit: they travel together)
    assert all(len({n.rsplit(".", 2)[0] for n, _ in b}) == 1 for b in small)
    assert sum(len(b) == 1 for b in small) > 3


def test_transformers_loads_the_export_and_matches_our_logits(tmp_path):
    from longctx_moe.hf.interop import to_hf_config

    policy = PolicyTrainer(config(*HF_SETS))
    model = policy.runtime.model
    tensors = {n: t for bucket in _export(policy) for n, t in bucket}
    safetensors.save_file(tensors, str(tmp_path / "model.safetensors"))
    to_hf_config(model.cfg).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    batch = packed_batch([9, 1, 17, 6], model.cfg.vocab_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.logits(batch)
        # Packed documents: position_ids restart per document, from which HF builds the
        # block-diagonal causal mask.
        theirs = hf(input_ids=batch.tokens[None], position_ids=batch.position_ids[None]).logits[0]
    assert ours.abs().max() > 1.0
    # float32 on both sides; HF computes in another order (fused experts, its own RMSNorm)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert hf.config.num_experts == model.cfg.num_experts and (tmp_path / "config.json").is_file()


def _rank(rank, world):
    policy = PolicyTrainer(config(*HF_SETS, "parallel.ep=2", "parallel.tp=2"))
    return _export(policy)


@pytest.mark.slow
def test_export_under_ep2_tp2_equals_one_process():
    want = [(n, t) for b in _export(PolicyTrainer(config(*HF_SETS))) for n, t in b]
    for buckets in run_distributed(_rank, world_size=4, timeout=300):
        got = [(n, t) for b in buckets for n, t in b]
        assert [n for n, _ in got] == [n for n, _ in want]
        for (name, a), (_, b) in zip(got, want, strict=True):
            assert torch.equal(a, b), name


def test_spec_shapes_are_the_global_slices_of_the_parameters():
    # Shapes come from checkpoint.sharded_state.global_slices (the splits declared on each piece),
    # not from names: a shared expert wider than the dense MLP keeps its own width.
    from longctx_moe.config import load_config
    from longctx_moe.hf.weights import weights_spec
    from longctx_moe.model import build_model

    cfg = load_config(None, ["model.shared_expert_hidden_size=96", "model.dense_hidden_size=64",
                             "model.first_k_dense=1", "model.hf_family=glm4_moe", "model.qk_norm=false",
                             "model.router_score=sigmoid", "model.expert_bias=true",
                             "model.expert_hidden_size=32"]).model
    spec = {s.name: s.shape for s in weights_spec(build_model(cfg), torch.float32)}
    d = cfg.hidden_size
    assert spec["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (96, d)
    assert spec["model.layers.1.mlp.shared_experts.down_proj.weight"] == (d, 96)
    assert spec["model.layers.0.mlp.up_proj.weight"] == (64, d)
    assert spec["model.layers.1.mlp.gate.e_score_correction_bias"] == (cfg.num_experts,)


def test_export_spec_of_a_tp_sharded_weight_has_its_global_shape():
    # The exporter's global shape is the split TP declared on the weight (parallel/sharding.py).
    from longctx_moe.config import load_config
    from longctx_moe.hf.weights import weights_spec
    from longctx_moe.model import build_model
    from longctx_moe.parallel.tensor_parallel import shard_swiglu

    cfg = load_config(None, ["model.dense_hidden_size=64", "model.first_k_dense=1"]).model
    model = build_model(cfg)
    shard_swiglu(model.layers[0].ffn, 1, 2, None)  # TP rank 1 of 2 (no forward: no group needed)
    assert model.layers[0].ffn.w_up.weight.shape[0] == 32
    shapes = {s.name: s.shape for s in weights_spec(model, torch.float32)}
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (64, cfg.hidden_size)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (cfg.hidden_size, 64)
