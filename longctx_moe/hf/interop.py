"""Hugging Face interop: our model's names in a family's terms (the family tables of
hf/families.py), and whole state dicts in transformers 5's in-memory layout.

Two HF layouts exist for the experts:
    on disk (every family's checkpoints, and what save_pretrained writes): one tensor per expert
        and projection, `{moe}.experts.{e}.{gate}` [F, D], `{up}` [F, D], `{down}` [D, F];
    in memory (transformers 5 fuses them on load): `mlp.experts.gate_up_proj` [E, 2F, D]
        (gate rows first) and `mlp.experts.down_proj` [E, D, F].
Ours: experts.w_gate_up [E, D, 2, F], experts.w_down [E, F, D] (see model/experts.GroupedExperts).
gpt-oss (a family with `fused_experts`) has one layout on disk and in memory: `mlp.experts.
gate_up_proj` [E, D, 2F] with gate and up interleaved (gate = [..., 0::2]), `gate_up_proj_bias`
[E, 2F] likewise, `down_proj` [E, F, D] and `down_proj_bias` [E, D] (`fused_pairs`).
"""

from __future__ import annotations

import torch

from longctx_moe.hf.families import Family, family_of, hf_config
from longctx_moe.model.config import ModelConfig

_ATTN = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
         "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm",
         "attn.k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
         "ffn_norm": "post_attention_layernorm"}
_DENSE = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_FUSED = {"ffn.experts.w_gate_up": "mlp.experts.gate_up_proj", "ffn.experts.w_down": "mlp.experts.down_proj"}


def _check_supported(cfg: ModelConfig) -> None:
    """ValueError naming the model.* key when cfg's family cannot express the model."""
    hf_config(cfg)


def to_hf_config(cfg: ModelConfig):
    """The transformers config of cfg's family (model.hf_family) for the identical architecture."""
    return hf_config(cfg)


def _family(cfg: ModelConfig) -> Family:
    return family_of(cfg.hf_family)


# MLA (model.mla) keeps transformers' DeepseekV3Attention names under attn. / self_attn.
_MLA = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
_MLA_Q = {True: ("q_a_proj", "q_a_layernorm", "q_b_proj"), False: ("q_proj",)}


def _attn_names(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    if cfg.attention_type == "mla":
        norms = [(ours + a + ".weight", hf + _ATTN[a] + ".weight") for a in ("attn_norm", "ffn_norm")]
        return norms + [(f"{ours}attn.{n}.weight", f"{hf}self_attn.{n}.weight")
                        for n in (*_MLA_Q[cfg.q_lora_rank > 0], *_MLA)] + _sinks(cfg, i)
    pairs = [(ours + a + ".weight", hf + b + ".weight") for a, b in _ATTN.items()
             if cfg.qk_norm or a not in ("attn.q_norm", "attn.k_norm")]
    if cfg.qkv_bias:
        pairs += [(ours + a + ".bias", hf + _ATTN[a] + ".bias") for a in ("attn.wq", "attn.wk", "attn.wv")]
    if cfg.attention_out_bias:
        pairs.append((ours + "attn.wo.bias", hf + "self_attn.o_proj.bias"))
    return pairs + _sinks(cfg, i)


def _sinks(cfg: ModelConfig, i: int) -> list[tuple[str, str]]:
    return [(f"layers.{i}.attn.sinks", f"model.layers.{i}.self_attn.sinks")] if cfg.attention_sinks else []


def _ffn_names(cfg: ModelConfig, i: int, moe: str) -> list[tuple[str, str]]:
    """Non-expert FFN tensors of layer i; `moe` is the MoE prefix (the family's on disk, `mlp`
    in memory)."""
    fam, ours, hf = _family(cfg), f"layers.{i}.ffn.", f"model.layers.{i}."
    if i < cfg.first_k_dense:
        return [(ours + a + ".weight", hf + "mlp." + b + ".weight") for a, b in _DENSE.items()]
    pairs = [(ours + "router.weight", f"{hf}{moe}.{fam.router}.weight")]
    if cfg.router_bias:
        pairs.append((ours + "router.bias", f"{hf}{moe}.{fam.router}.bias"))
    if cfg.expert_bias:
        pairs.append((ours + "router.expert_bias", hf + moe + ".gate.e_score_correction_bias"))
    if cfg.shared_expert_hidden_size:
        pairs += [(ours + "shared." + a + ".weight", f"{hf}{moe}.{fam.shared}.{b}.weight") for a, b in _DENSE.items()]
    if cfg.shared_expert_gate:
        pairs.append((ours + "shared.gate.weight", hf + moe + ".shared_expert_gate.weight"))
    return pairs


def name_pairs(cfg: ModelConfig, on_disk: bool = True) -> list[tuple[str, str]]:
    """(our state-dict name, HF name) of every tensor but the routed experts, in export order."""
    moe = _family(cfg).moe if on_disk else "mlp"
    pairs = [("embed.weight", "model.embed_tokens.weight")]
    for i in range(cfg.num_layers):
        pairs += _attn_names(cfg, i) + _ffn_names(cfg, i, moe)
    pairs.append(("norm.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    return pairs


def expert_names(cfg: ModelConfig, layer: int, e: int) -> tuple[str, str, str]:
    """On-disk HF names of expert `e`'s gate [F, D], up [F, D] and down [D, F] in `layer`."""
    fam = _family(cfg)
    base = f"model.layers.{layer}.{fam.moe}.experts.{e}."
    return tuple(base + n + ".weight" for n in fam.expert_names)


_FUSED_BIASED = {"w_gate_up": "gate_up_proj", "b_gate_up": "gate_up_proj_bias",
                 "w_down": "down_proj", "b_down": "down_proj_bias"}


def fused_pairs(cfg: ModelConfig, layer: int) -> list[tuple[str, str]]:
    """(our experts.* parameter name, HF name) of a `fused_experts` family's layer (gpt-oss),
    the biases where cfg has them; convert values with to_fused / from_fused."""
    fam = _family(cfg)
    names = list(_FUSED_BIASED.items()) if cfg.expert_proj_bias else [
        (a, b) for a, b in _FUSED_BIASED.items() if a.startswith("w_")]
    return [(f"layers.{layer}.ffn.experts.{a}", f"model.layers.{layer}.{fam.moe}.experts.{b}") for a, b in names]


def to_fused(name: str, t: torch.Tensor) -> torch.Tensor:
    """Our expert tensor `name` (.w_gate_up [.., 2, F], .b_gate_up [.., 2, F], or the down
    ones, as they are) in gpt-oss's layout: gate and up interleaved on the last dim."""
    return t.transpose(-2, -1).flatten(-2) if name.endswith("gate_up") else t


def from_fused(name: str, t: torch.Tensor) -> torch.Tensor:
    """Inverse of to_fused: [.., 2F] interleaved -> [.., 2, F]."""
    return t.unflatten(-1, (t.shape[-1] // 2, 2)).transpose(-2, -1) if name.endswith("gate_up") else t


def fused_expert_names(layer: int) -> tuple[str, str]:
    """transformers 5's in-memory gate_up_proj [E, 2F, D] and down_proj [E, D, F] of `layer`."""
    return tuple(f"model.layers.{layer}.{v}" for v in _FUSED.values())


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    """State dict loadable by transformers' in-memory model of cfg's family (copies)."""
    cfg = model.cfg
    _check_supported(cfg)
    ours = model.state_dict()
    out = {b: ours[a].contiguous().clone() for a, b in name_pairs(cfg, on_disk=False)}
    for i in range(cfg.first_k_dense, cfg.num_layers):
        if _family(cfg).fused_experts:
            out.update((b, to_fused(a, ours[a]).contiguous().clone()) for a, b in fused_pairs(cfg, i))
            continue
        gate_up, down = fused_expert_names(i)
        out[gate_up] = ours[f"layers.{i}.ffn.experts.w_gate_up"].flatten(2).transpose(-2, -1).contiguous().clone()
        out[down] = ours[f"layers.{i}.ffn.experts.w_down"].transpose(-2, -1).contiguous().clone()
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our model's state dict (load with model.load_state_dict) from a transformers 5 in-memory one."""
    _check_supported(cfg)
    pairs = name_pairs(cfg, on_disk=False)
    fused_family = _family(cfg).fused_experts
    layers = range(cfg.first_k_dense, cfg.num_layers)
    fused = ([b for i in layers for _, b in fused_pairs(cfg, i)] if fused_family
             else [n for i in layers for n in fused_expert_names(i)])
    expected = {b for _, b in pairs} | set(fused) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing, unexpected = expected - sd.keys(), sd.keys() - expected
    if missing or unexpected:
        raise ValueError(f"HF state dict does not match model config: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}; build cfg from the checkpoint's config")
    out = {a: sd[b].contiguous().clone() for a, b in pairs}
    for i in layers:
        if fused_family:
            out.update((a, from_fused(a, sd[b]).contiguous().clone()) for a, b in fused_pairs(cfg, i))
        else:
            gate_up, down = fused_expert_names(i)
            out[f"layers.{i}.ffn.experts.w_gate_up"] = (
                sd[gate_up].transpose(-2, -1).unflatten(2, (2, cfg.expert_hidden_size)).contiguous().clone())
            out[f"layers.{i}.ffn.experts.w_down"] = sd[down].transpose(-2, -1).contiguous().clone()
        if not cfg.expert_bias:  # the aux-loss-free bias is ours alone: HF routes with none
            out[f"layers.{i}.ffn.router.expert_bias"] = torch.zeros(cfg.num_experts, dtype=torch.float32)
    return out
