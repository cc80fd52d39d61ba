"""The registry of Hugging Face MoE families this model can be: one `Family` per `model_type`.

Each family is a small table: how its config.json keys become model.* (straight copies, values
the family implies, and settings we refuse, each named by its HF key), and how its weight names
map to ours. Everything else (hf/load.py, hf/export.py, hf/weights.py, the config fill of
train.init_from) reads these tables; no other file branches on the family.

model.* is the architecture and nothing else: for every family, export writes every ModelConfig
field and import (model_values) reads every one back, as a copied key, a value derived from
several keys, one the family implies, or one computed as transformers does
(tests/hf/test_config_sets.py compares the sets).

Our names vs. a family's (layer i; `moe` is the family's MoE prefix, `mlp` or `block_sparse_moe`):
    attn.wq|wk|wv|wo            self_attn.q_proj|k_proj|v_proj|o_proj  (.weight, q/k/v .bias)
    attn.q_norm|k_norm          self_attn.q_norm|k_norm
    attn.<name> (MLA)           self_attn.<name>: q_a_proj, q_a_layernorm, q_b_proj (or q_proj),
                                kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (deepseek_v3)
    attn_norm, ffn_norm         input_layernorm, post_attention_layernorm
    ffn.w_gate|w_up|w_down      mlp.gate_proj|up_proj|down_proj        (dense layers)
    ffn.router.weight           {moe}.gate.weight
    ffn.router.expert_bias      {moe}.gate.e_score_correction_bias      (where the family has it)
    ffn.shared.w_gate|w_up|w_down  {moe}.{shared}.gate_proj|up_proj|down_proj
    ffn.shared.gate.weight      {moe}.shared_expert_gate.weight
    ffn.experts.w_gate_up [E, D, 2, F]  {moe}.experts.{e}.{gate}|{up} [F, D] per expert
    ffn.experts.w_down [E, F, D]        {moe}.experts.{e}.{down} [D, F] per expert
gpt-oss (`fused_experts`: its checkpoints hold each layer's experts as single tensors):
    attn.sinks, attn.wo.bias    self_attn.sinks [H], self_attn.o_proj.bias
    ffn.router.weight|bias      mlp.router.weight|bias
    ffn.experts.w_gate_up|b_gate_up  mlp.experts.gate_up_proj [E, D, 2F] | gate_up_proj_bias
                                [E, 2F], gate and up INTERLEAVED on the last dim (gate = 0::2)
    ffn.experts.w_down|b_down   mlp.experts.down_proj [E, F, D] | down_proj_bias [E, D]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from longctx_moe.model.config import ModelConfig

# config.json key -> model.* key, shared by every family.
COMMON_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
               "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
               "num_key_value_heads": "num_kv_heads", "num_experts_per_tok": "top_k",
               "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings",
               "initializer_range": "init_std", "max_position_embeddings": "max_position_embeddings"}
# model.* keys a config.json may leave out, computed from it as transformers does.
COMPUTED = {"head_dim": lambda hf: hf["hidden_size"] // hf["num_attention_heads"],
            "num_kv_heads": lambda hf: hf["num_attention_heads"]}
# model.* keys every family writes and reads outside the tables: the model_type, and RoPE's base
# in rope_parameters (_rope, _rope_parameters).
OWN_KEYS = ("hf_family", "rope_theta")

# Another name transformers 5 writes for a key (Qwen3MoeConfig saves num_local_experts).
# gpt-oss's own config.json also says experts_per_token.
ALIASES = {"num_experts": "num_local_experts", "num_experts_per_tok": "experts_per_token"}

# The architecture keys a family may leave unmapped, at the value that means "not there" (a
# family without dense layers has no dense width: ModelConfig's default stands for none).
FEATURE_DEFAULTS = {"qkv_bias": False, "qk_norm_scope": "head", "shared_expert_hidden_size": 0,
                    "shared_expert_gate": False, "first_k_dense": 0, "router_groups": 1,
                    "router_topk_groups": 1, "routed_scaling_factor": 1.0, "expert_bias": False,
                    "partial_rotary_factor": 1.0, "rope_scaling": None, "attention_type": "gqa",
                    "attention_sinks": False, "attention_out_bias": False, "sliding_window": 0,
                    "layer_types": None, "router_bias": False, "expert_proj_bias": False,
                    "expert_activation": "swiglu", "swiglu_limit": 7.0, "dense_hidden_size": 512,
                    "q_lora_rank": 0, "kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
                    "v_head_dim": 0, "rope_interleave": False}
# DeepSeek-V3's MLA: config.json key -> model.* key (q_lora_rank null = no q bottleneck = 0).
MLA_KEYS = {"kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
            "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"}
# YaRN keys carried into model.rope_scaling (model.rope), as config.json spells them.
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")


@dataclass(frozen=True)
class Refusal:
    """A config.json setting the model cannot express: `bad(value)` is true for refused values
    (`value` is None where the key is absent)."""

    key: str
    bad: Callable[[object], bool]
    why: str


@dataclass(frozen=True)
class Family:
    model_type: str
    config_class: str  # the transformers config class
    architecture: str  # config.json "architectures"
    keys: dict[str, str]  # config.json key -> model.* key (beyond COMMON_KEYS)
    implied: dict[str, object]  # model.* values every checkpoint of the family has
    refusals: tuple[Refusal, ...] = ()
    moe: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str = "shared_expert"
    router: str = "gate"  # the router's module name under {moe}
    fused_experts: bool = False  # gpt-oss's on-disk experts (module doc), else one per expert
    derive: Callable[[dict], dict] | None = None  # model.* values computed from several keys
    # model.* keys set beyond `keys` (by `derive`, or the RoPE reader) that the export writes back
    derives: tuple[str, ...] = ()
    export: Callable[[ModelConfig], dict] | None = None  # HF kwargs beyond the inverted keys
    fixed_hf: dict[str, object] = field(default_factory=dict)  # HF kwargs we always write


def _not(value) -> Callable[[object], bool]:
    return lambda v: v not in (None, value)


def _truthy(v) -> bool:
    return bool(v)


def _dense_width(hf: dict) -> dict:
    """intermediate_size, the dense MLP's width in Qwen, GLM and DeepSeek configs, whether or not
    a layer is dense (export writes it either way)."""
    width = hf.get("intermediate_size")
    return {} if width is None else {"dense_hidden_size": width}


def _dense_prefix(hf: dict) -> dict:
    """Qwen's mlp_only_layers as first_k_dense: only a prefix [0, k) of dense layers exists here."""
    layers = sorted(hf.get("mlp_only_layers") or [])
    if layers != list(range(len(layers))):
        raise_family(f"mlp_only_layers={layers}", hf, "only the first k layers may be dense here")
    return {"first_k_dense": len(layers), **_dense_width(hf)}


def _qwen_export(cfg: ModelConfig) -> dict:
    return {"mlp_only_layers": list(range(cfg.first_k_dense)), "intermediate_size": cfg.dense_hidden_size,
            "decoder_sparse_step": 1, "use_sliding_window": False}


def _qwen2_derive(hf: dict) -> dict:
    width = hf.get("shared_expert_intermediate_size", 0)
    return {**_dense_prefix(hf), "shared_expert_hidden_size": width, "shared_expert_gate": width > 0}


def _glm_derive(hf: dict) -> dict:
    return {"first_k_dense": hf.get("first_k_dense_replace", 0), **_dense_width(hf),
            "shared_expert_hidden_size": hf.get("n_shared_experts", 0) * hf["moe_intermediate_size"]}


def _glm_export(cfg: ModelConfig) -> dict:
    shared, f = cfg.shared_expert_hidden_size, cfg.expert_hidden_size
    if shared % f:
        raise ValueError(f"glm4_moe writes shared experts as n_shared_experts x moe_intermediate_size; "
                         f"model.shared_expert_hidden_size={shared} is not a multiple of {f}")
    return {"first_k_dense_replace": cfg.first_k_dense, "intermediate_size": cfg.dense_hidden_size,
            "n_shared_experts": shared // f, "partial_rotary_factor": cfg.partial_rotary_factor}


def _deepseek_derive(hf: dict) -> dict:
    # rope_interleave: transformers' default (the published DeepSeek-V3 config.json leaves it out;
    # its weights hold the rope dims interleaved)
    return {**_glm_derive(hf), "q_lora_rank": hf.get("q_lora_rank") or 0,
            "rope_interleave": bool(hf.get("rope_interleave", True))}


def _deepseek_export(cfg: ModelConfig) -> dict:
    out = _glm_export(cfg)
    del out["partial_rotary_factor"]
    return {**out, "q_lora_rank": cfg.q_lora_rank or None, "head_dim": cfg.qk_rope_head_dim,
            "rope_interleave": cfg.rope_interleave}


def _gpt_oss_derive(hf: dict) -> dict:
    """attention_bias covers q/k/v and o_proj alike; a window of 0 is None; layer_types that all
    say what no layer_types means (every layer windowed, or none) read as None."""
    bias = bool(hf.get("attention_bias", True))
    window = hf.get("sliding_window") or 0
    kinds = hf.get("layer_types")
    uniform = "sliding_attention" if window else "full_attention"
    if kinds is not None and all(k == uniform for k in kinds):
        kinds = None
    return {"qkv_bias": bias, "attention_out_bias": bias, "sliding_window": window,
            "layer_types": None if kinds is None else list(kinds)}


def _gpt_oss_export(cfg: ModelConfig) -> dict:
    uniform = "sliding_attention" if cfg.sliding_window else "full_attention"
    return {"attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window or None,
            "layer_types": list(cfg.layer_types or [uniform] * cfg.num_layers), "head_dim": cfg.head_dim}


_NO_SLIDING = Refusal("use_sliding_window", _truthy, "sliding-window attention")
_QWEN_SPARSE = Refusal("decoder_sparse_step", _not(1), "MoE every k-th layer")

FAMILIES = {f.model_type: f for f in (
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
           keys={"num_experts": "num_experts", "moe_intermediate_size": "expert_hidden_size",
                 "norm_topk_prob": "router_renormalize", "head_dim": "head_dim"},
           implied={"qk_norm": True, "qk_norm_scope": "head", "qkv_bias": False, "router_score": "softmax",
                    "shared_expert_hidden_size": 0, "shared_expert_gate": False, "expert_bias": False},
           refusals=(_NO_SLIDING, _QWEN_SPARSE, Refusal("attention_bias", _truthy, "attention biases"),),
           derive=_dense_prefix, derives=("first_k_dense", "dense_hidden_size"), export=_qwen_export),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           keys={"num_experts": "num_experts", "moe_intermediate_size": "expert_hidden_size",
                 "norm_topk_prob": "router_renormalize", "qkv_bias": "qkv_bias"},
           implied={"qk_norm": False, "router_score": "softmax", "expert_bias": False},
           refusals=(_NO_SLIDING, _QWEN_SPARSE), derive=_qwen2_derive,
           derives=("first_k_dense", "dense_hidden_size", "shared_expert_hidden_size", "shared_expert_gate"),
           export=lambda cfg: {**_qwen_export(cfg), "shared_expert_intermediate_size": cfg.shared_expert_hidden_size}),
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM",
           keys={"num_local_experts": "num_experts", "intermediate_size": "expert_hidden_size",
                 "head_dim": "head_dim"},
           implied={"qk_norm": False, "qkv_bias": False, "router_score": "softmax", "router_renormalize": True,
                    "shared_expert_hidden_size": 0, "first_k_dense": 0, "expert_bias": False},
           refusals=(Refusal("sliding_window", _not(None), "sliding-window attention"),
                     Refusal("router_jitter_noise", _not(0.0), "router jitter noise")),
           moe="block_sparse_moe", expert_names=("w1", "w3", "w2"), fixed_hf={"sliding_window": None}),
    Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM",
           keys={"num_experts": "num_experts", "intermediate_size": "expert_hidden_size",
                 "norm_topk_prob": "router_renormalize"},
           implied={"qk_norm": True, "qk_norm_scope": "full", "qkv_bias": False, "router_score": "softmax",
                    "shared_expert_hidden_size": 0, "first_k_dense": 0, "expert_bias": False},
           refusals=(Refusal("attention_bias", _truthy, "attention biases"),
                     Refusal("clip_qkv", _not(None), "clipping of q, k and v"))),
    Family("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
           keys={"n_routed_experts": "num_experts", "moe_intermediate_size": "expert_hidden_size",
                 "norm_topk_prob": "router_renormalize", "head_dim": "head_dim",
                 "attention_bias": "qkv_bias", "use_qk_norm": "qk_norm", "n_group": "router_groups",
                 "topk_group": "router_topk_groups", "routed_scaling_factor": "routed_scaling_factor"},
           implied={"qk_norm_scope": "head", "router_score": "sigmoid", "expert_bias": True,
                    "shared_expert_gate": False},
           shared="shared_experts", derive=_glm_derive,
           derives=("first_k_dense", "dense_hidden_size", "shared_expert_hidden_size", "partial_rotary_factor"),
           export=_glm_export),
    Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           keys={"n_routed_experts": "num_experts", "moe_intermediate_size": "expert_hidden_size",
                 "norm_topk_prob": "router_renormalize", "n_group": "router_groups",
                 "topk_group": "router_topk_groups", "routed_scaling_factor": "routed_scaling_factor",
                 **MLA_KEYS},
           implied={"attention_type": "mla", "qk_norm": False, "qkv_bias": False,
                    "router_score": "sigmoid", "expert_bias": True, "shared_expert_gate": False},
           refusals=(Refusal("attention_bias", _truthy, "attention biases"),),
           shared="shared_experts", derive=_deepseek_derive,
           derives=("first_k_dense", "dense_hidden_size", "shared_expert_hidden_size", "q_lora_rank",
                    "rope_interleave", "rope_scaling"),
           export=_deepseek_export),
    # transformers' GptOssExperts clamps at 7.0 whatever swiglu_limit says: other limits are refused.
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
           keys={"num_local_experts": "num_experts", "intermediate_size": "expert_hidden_size",
                 "head_dim": "head_dim"},
           implied={"qk_norm": False, "router_score": "softmax", "router_renormalize": True,
                    "router_bias": True, "attention_sinks": True, "expert_proj_bias": True,
                    "expert_activation": "clamped_swiglu", "swiglu_limit": 7.0,
                    "shared_expert_hidden_size": 0, "first_k_dense": 0, "expert_bias": False},
           refusals=(Refusal("swiglu_limit", _not(7.0), "transformers' gpt-oss experts clamp at 7.0"),
                     Refusal("quantization_config", _not(None),
                             "quantized (MXFP4) experts; dequantize the checkpoint to bf16 first")),
           router="router", fused_experts=True, derive=_gpt_oss_derive,
           derives=("qkv_bias", "attention_out_bias", "sliding_window", "layer_types", "rope_scaling"),
           export=_gpt_oss_export, fixed_hf={"swiglu_limit": 7.0}),
)}


def raise_family(setting: str, hf: dict, why: str):
    from longctx_moe.config import ConfigError

    raise ConfigError(f"config.json: {setting} ({hf.get('model_type')}) is not supported by this "
                      f"model: {why}; use a checkpoint without it")


def family_of(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        from longctx_moe.config import ConfigError

        raise ConfigError(f"config.json: model_type={model_type!r} is not a supported family; "
                          f"supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def _rope(hf: dict) -> dict:
    """rope_theta, partial_rotary_factor and a YaRN rope_scaling (model.rope) from transformers
    5's rope_parameters (or the older top-level keys); other RoPE variants are refused by name."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise_family(f"rope_parameters.rope_type={kind!r}", hf, "plain RoPE and YaRN are implemented")
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
           "partial_rotary_factor": float(rope.get("partial_rotary_factor",
                                                   hf.get("partial_rotary_factor") or 1.0))}
    if kind == "yarn":
        out["rope_scaling"] = {"type": "yarn", **{k: rope[k] for k in _YARN_KEYS
                                                  if rope.get(k) is not None}}
    return out


def model_values(hf: dict) -> dict:
    """model.* values (the architecture) of a config.json dict; ConfigError (one line, naming
    the HF key) for a family or setting the model cannot express."""
    fam = family_of(hf.get("model_type"))
    if hf.get("hidden_act", "silu") != "silu":
        raise_family(f"hidden_act={hf['hidden_act']!r}", hf, "experts and MLPs are SwiGLU (silu)")
    for r in fam.refusals:
        if r.bad(hf.get(r.key)):
            raise_family(f"{r.key}={hf.get(r.key)!r}", hf, r.why)
    out = {**FEATURE_DEFAULTS, "hf_family": fam.model_type, **fam.implied}
    for hf_key, key in {**COMMON_KEYS, **fam.keys}.items():
        value = hf.get(hf_key, hf.get(ALIASES.get(hf_key, "")))
        if value is not None:
            out[key] = value
    for key, compute in COMPUTED.items():
        out.setdefault(key, compute(hf))
    out.update(_rope(hf))
    if fam.derive is not None:
        out.update(fam.derive(hf))
    return out


def _rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5's rope_parameters of cfg (inverse of _rope)."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    yarn = {k: v for k, v in cfg.rope_scaling.items() if k not in ("type", "rope_type")}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **yarn}


def check_expressible(cfg: ModelConfig) -> Family:
    """cfg's family, after checking the values every checkpoint of it has (ValueError naming the
    model.* key otherwise); hf_config checks the rest by reading its own config back."""
    fam = family_of(cfg.hf_family)
    for key, want in {**FEATURE_DEFAULTS, **fam.implied}.items():
        if key in fam.implied or not _maps(fam, key):
            if getattr(cfg, key) != want:
                raise ValueError(f"{fam.model_type} cannot express this model: model.{key} must be {want!r} "
                                 "for HF interop (or pick another model.hf_family)")
    return fam


def _maps(fam: Family, key: str) -> bool:
    """Whether some config.json key of `fam` sets model.`key` (directly or derived)."""
    return key in fam.keys.values() or key in fam.derives


def hf_config(cfg: ModelConfig):
    """The transformers config object of `cfg`'s family; ValueError naming the model.* key for a
    feature the family cannot express, or one that would not read back as it is."""
    import transformers

    fam = check_expressible(cfg)
    kwargs = {hf_key: getattr(cfg, key) for hf_key, key in {**COMMON_KEYS, **fam.keys}.items()}
    kwargs.update(hidden_act="silu", use_cache=False, rope_parameters=_rope_parameters(cfg), **fam.fixed_hf)
    if fam.export is not None:
        kwargs.update(fam.export(cfg))
    hf = getattr(transformers, fam.config_class)(**kwargs)
    back = model_values(hf.to_dict())  # what a reader of this config.json would build
    for key, value in back.items():
        if key != "hf_family" and getattr(cfg, key) != value:
            raise ValueError(f"{fam.model_type} cannot express this model: model.{key}={getattr(cfg, key)!r} "
                             f"would read back as {value!r}; pick another model.hf_family")
    hf.architectures = [fam.architecture]
    return hf
