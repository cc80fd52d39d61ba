"""Every supported Hugging Face MoE family, on small random checkpoints saved by transformers:
train.init_from's config fill and lazy load, per-token log-probs of packed documents against
transformers' forward on each document alone, a training step, and export -> transformers load."""

from __future__ import annotations

import json

import pytest
import torch

from longctx_moe.config import ConfigError, load_config
from longctx_moe.hf.load import load_hf_model
from tests.hf.families_cases import (
    IDS,
    PARAMS,
    batch_docs,
    hf_config,
    hf_float64,
    hf_token_logprobs,
    packed_logprobs,
    save_random,
)
from tests.model.helpers import packed_batch

transformers = pytest.importorskip("transformers")
DOCS = [7, 1, 12, 5]  # packed together; a one-token document has no target


@pytest.fixture(params=PARAMS, ids=IDS)
def checkpoint(request, tmp_path):
    family, kwargs = request.param
    path = tmp_path / "hf"
    return family, kwargs, path, save_random(family, kwargs, path)


def test_packed_logprobs_match_transformers_per_document(checkpoint):
    family, kwargs, path, hf = checkpoint
    ours = load_hf_model(path)
    assert ours.cfg.hf_family == family
    batch = packed_batch(DOCS, ours.cfg.vocab_size, generator=torch.Generator().manual_seed(1))
    mine, theirs = packed_logprobs(ours, batch), hf_token_logprobs(hf, batch_docs(batch))
    # float32 on both sides: the two forwards round differently (fused vs. per-expert GEMMs,
    # attention kernels), ~1e-6 on log-probs of size ~5 after a few layers.
    for m, t in zip(mine, theirs, strict=True):
        torch.testing.assert_close(m, t, atol=2e-5, rtol=0)
    assert torch.cat(theirs).std() > 0.1  # weights large enough that routing matters


def test_packed_logprobs_match_transformers_in_float64(checkpoint):
    """Both models in float64 (transformers' float32 casts lifted): only rounding is left, so a
    mismatch far below the float32 tolerance (a wrong eps, a mask value) still shows."""
    family, kwargs, path, hf = checkpoint
    ours = load_hf_model(path).double()
    batch = packed_batch(DOCS, ours.cfg.vocab_size, generator=torch.Generator().manual_seed(1))
    with hf_float64(hf.double()):
        theirs = hf_token_logprobs(hf, batch_docs(batch))
    for m, t in zip(packed_logprobs(ours, batch), theirs, strict=True):
        torch.testing.assert_close(m, t, atol=1e-10, rtol=0)


def test_export_loads_in_transformers_with_the_same_logits(checkpoint, tmp_path):
    from longctx_moe.hf.export import write_config_json, write_safetensors

    family, kwargs, path, hf = checkpoint
    ours = load_hf_model(path)
    with torch.no_grad():  # a trained model: every tensor moved, so the export is not the input
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = tmp_path / "export"
    out.mkdir()
    files = write_safetensors(ours, out, torch.float32, 1 << 20)
    write_config_json(ours.cfg, out, torch.float32)
    from safetensors import safe_open

    from longctx_moe.hf.weights import weights_spec

    written = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            written.update((k, tuple(h.get_slice(k).get_shape())) for k in h.keys())
    assert written == {s.name: tuple(s.shape) for s in weights_spec(ours, torch.float32)}
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    batch = packed_batch([9], ours.cfg.vocab_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine = ours.logits(batch)
        theirs = back(input_ids=batch.tokens[None]).logits[0]
    # float32 logits of size ~3.5: ~1e-6 apart for most families (as the log-probs above); gpt-oss
    # with its sinks and windows reaches 2.3e-5 (transformers 5.10's eager sink attention
    # normalises in another order, and our fused RMSNorm sums each row in another order: 9e-6
    # with the torch norm)
    torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=0)
    again = load_hf_model(out)  # and our reader takes the export back exactly
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values(), strict=True))


def test_a_training_step_moves_every_weight(checkpoint):
    family, kwargs, path, hf = checkpoint
    ours = load_hf_model(path).train()
    batch = packed_batch(DOCS, ours.cfg.vocab_size, generator=torch.Generator().manual_seed(3))
    out = ours(batch)
    (out.ce_sum / batch.num_target_tokens() + out.aux_loss + out.z_loss).backward()
    dead = [n for n, p in ours.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"no gradient reached {dead}"


def test_architecture_setting_that_contradicts_config_json_is_refused(tmp_path):
    save_random("mixtral", PARAMS[2][1], tmp_path)
    with pytest.raises(ConfigError, match="config.json gives model.num_experts=4 but the config sets"):
        load_config(None, [f"train.init_from={tmp_path}", "model.num_experts=8"])
    cfg = load_config(None, [f"train.init_from={tmp_path}", "model.num_experts=4", "balance.aux_loss_coeff=0"])
    assert (cfg.model.num_experts, cfg.model.router_renormalize, cfg.balance.aux_loss_coeff) == (4, True, 0)


@pytest.mark.parametrize("family,key,value,named", [
    ("mixtral", "sliding_window", 4096, "sliding_window=4096 (mixtral)"),
    ("olmoe", "clip_qkv", 8.0, "clip_qkv=8.0 (olmoe)"),
    ("glm4_moe", "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
     "rope_parameters.rope_type='dynamic' (glm4_moe)"),
    ("qwen2_moe", "use_sliding_window", True, "use_sliding_window=True (qwen2_moe)")])
def test_unsupported_hf_setting_is_refused_naming_the_key(tmp_path, family, key, value, named):
    kwargs = {**dict(PARAMS[IDS.index(f"{family}-0")][1]), key: value}
    hf_config(family, kwargs).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"train.init_from={tmp_path}"])


def test_unknown_family_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "jamba"}))
    with pytest.raises(ConfigError, match="model_type='jamba' is not a supported family"):
        load_config(None, [f"train.init_from={tmp_path}"])


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_family_configs_are_expressible_in_their_family(family):
    from pathlib import Path

    from longctx_moe.hf.interop import to_hf_config

    cfg = load_config(Path(__file__).resolve().parents[2] / f"configs/families/{family}_tiny.yaml")
    hf = to_hf_config(cfg.model)  # reads its own config.json values back: raises on any loss
    assert (cfg.model.hf_family, hf.model_type) == (family, family)


def test_a_model_its_family_cannot_express_is_refused_by_key():
    from longctx_moe.hf.interop import to_hf_config
    from tests.model.helpers import tiny_config

    with pytest.raises(ValueError, match="mixtral cannot express this model: model.shared_expert_hidden_size"):
        to_hf_config(tiny_config(hf_family="mixtral", qk_norm=False, shared_expert_hidden_size=8))
    with pytest.raises(ValueError, match="olmoe cannot express this model: model.router_groups"):
        to_hf_config(tiny_config(hf_family="olmoe", qk_norm_scope="full", router_renormalize=False,
                                 router_groups=2, router_topk_groups=1))


def test_full_width_qk_norm_with_replicated_kv_heads_is_refused():
    from longctx_moe.model import build_model
    from longctx_moe.parallel.tensor_parallel import check_tensor_parallel
    from tests.model.helpers import tiny_config

    model = build_model(tiny_config(qk_norm_scope="full", num_heads=4, num_kv_heads=2))
    check_tensor_parallel(model, 2)  # KV heads split: the norm's sum of squares is reduced over TP
    with pytest.raises(ValueError, match="qk_norm_scope=full .* tp=4 replicates num_kv_heads=2"):
        check_tensor_parallel(model, 4)


def test_from_pretrained_config_takes_the_architecture_from_config_json(tmp_path):
    from pathlib import Path

    save_random("olmoe", PARAMS[IDS.index("olmoe-1")][1], tmp_path)
    yaml = Path(__file__).resolve().parents[2] / "configs/from_pretrained.yaml"
    cfg = load_config(yaml, [f"train.init_from={tmp_path}"])
    m = cfg.model
    assert (m.hf_family, m.num_experts, m.top_k, m.qk_norm_scope, m.router_renormalize) == ("olmoe", 8, 3, "full", True)
    assert cfg.balance.aux_loss_coeff == 1e-3  # not architecture: the YAML's value stands


def test_in_memory_state_dicts_round_trip(checkpoint):
    """transformers' in-memory state dict (gpt-oss: its fused, interleaved experts) <-> ours."""
    from longctx_moe.hf.interop import from_hf_state_dict, to_hf_state_dict

    family, kwargs, path, hf = checkpoint
    ours = load_hf_model(path)
    mine = from_hf_state_dict(hf.state_dict(), ours.cfg)
    assert all(torch.equal(mine[k], v) for k, v in ours.state_dict().items())
    back = to_hf_state_dict(ours)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
