"""Hugging Face Qwen3-MoE interop: logits parity on one document and exact state-dict round trips."""

import pytest
import torch

from longctx_moe.hf.interop import from_hf_state_dict, to_hf_config, to_hf_state_dict
from longctx_moe.model import build_model
from tests.model.helpers import packed_batch, tiny_config

transformers = pytest.importorskip("transformers")


def _hf_model(cfg):
    hcfg = to_hf_config(cfg)
    hcfg._attn_implementation = "eager"
    hcfg._experts_implementation = "eager"  # HF's grouped_mm experts reject float64
    return transformers.Qwen3MoeForCausalLM(hcfg).double().eval()


@pytest.mark.parametrize("overrides", [{}, {"first_k_dense": 1, "num_layers": 3, "tie_embeddings": True,
                                            "router_renormalize": False}])
def test_logits_match_hf_qwen3_moe(overrides):
    torch.manual_seed(0)
    cfg = tiny_config(init_std=0.2, **overrides)
    ours = build_model(cfg).double().eval()
    hf = _hf_model(cfg)
    hf.load_state_dict(to_hf_state_dict(ours), strict=True)
    batch = packed_batch([29], cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours.logits(batch)
        theirs = hf(input_ids=batch.tokens[None], position_ids=batch.position_ids[None]).logits[0]
    # Even for a float64 model HF computes RMSNorm, the attention softmax and the router softmax in
    # fp32, so agreement is limited to fp32 rounding (~1e-7 relative) on logits of size ~3.
    assert mine.abs().max() > 1.0
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_state_dict_round_trips_exactly():
    torch.manual_seed(0)
    cfg = tiny_config(first_k_dense=1, num_layers=3)
    ours = build_model(cfg)
    hf = _hf_model(cfg).float()
    hf_sd = hf.state_dict()
    back = to_hf_state_dict(_load(cfg, from_hf_state_dict(hf_sd, cfg)))
    assert back.keys() == hf_sd.keys()
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    again = from_hf_state_dict(to_hf_state_dict(ours), cfg)
    assert again.keys() == ours.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def _load(cfg, sd):
    model = build_model(cfg)
    model.load_state_dict(sd, strict=True)
    return model


@pytest.mark.parametrize("key,value", [("router_score", "sigmoid"), ("shared_expert_hidden_size", 8),
                                       ("expert_bias", True), ("qk_norm", False)])
def test_unsupported_features_are_refused(key, value):
    cfg = tiny_config(**{key: value})
    with pytest.raises(ValueError, match=f"model.{key}"):
        to_hf_config(cfg)


def test_mismatched_checkpoint_is_refused():
    cfg = tiny_config()
    sd = to_hf_state_dict(build_model(cfg))
    with pytest.raises(ValueError, match="missing"):
        from_hf_state_dict(sd, tiny_config(num_layers=3))
