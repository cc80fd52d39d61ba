"""Reading a Hugging Face directory into our model (`train.init_from`, PolicyTrainer.from_pretrained).

    fill_model_from_hf   config.json -> the architecture keys of model.* (the family's table in
                         hf/families.py); a setting the user gave that contradicts it is refused
    load_hf_sharded      each rank reads only the slices of its own parameters, lazily, with
                         safetensors' safe_open + get_slice: the slices are those
                         checkpoint.sharded_state.global_slices says the rank holds (the one owner of every
                         piece's global shape and offsets), so no rank builds the whole model

Expert tensors are read per expert (`experts.{e}.gate_proj` ..., every family's on-disk form) or
from transformers 5's fused `mlp.experts.gate_up_proj` / `down_proj`, whichever the files hold;
gpt-oss's are its own fused, interleaved, biased tensors (hf/interop.py).
Legend: E experts, L local experts, D hidden, F expert hidden (f: this rank's F slice).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from longctx_moe.config import ConfigError
from longctx_moe.hf.families import check_expressible, family_of, model_values
from longctx_moe.hf.interop import (
    expert_names,
    from_fused,
    fused_expert_names,
    fused_pairs,
    name_pairs,
)


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.init_from='{hf_dir}': cannot read '{path}' ({e}); point it at a Hugging "
                          "Face model directory or an export-hf output") from None


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-12)
    return a == b


def fill_model_from_hf(data: dict, hf_dir: str) -> None:
    """Set data["model"]'s architecture keys from `hf_dir`/config.json, in place. A key the
    config (YAML or --set) already gives must agree; ConfigError names the first that does not."""
    from longctx_moe.config import _coerce, _field_types
    from longctx_moe.model.config import ModelConfig

    values = model_values(read_hf_config(hf_dir))
    model = data.setdefault("model", {}) or {}
    data["model"] = model
    types = _field_types(ModelConfig)
    for key, value in values.items():
        if key in model and not _same(_coerce(f"model.{key}", model[key], types[key]), value):
            raise ConfigError(f"train.init_from='{hf_dir}': config.json gives model.{key}={value!r} but the "
                              f"config sets model.{key}={model[key]!r}; drop that setting (init_from "
                              "fills the architecture) or init from a matching directory")
        model[key] = value


class HFTensors:
    """The tensors of a directory's *.safetensors files, opened lazily; `slice` reads only the
    asked-for rectangle and counts the bytes it read."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"train.init_from='{hf_dir}' holds no *.safetensors file; export one with "
                              "longctx-moe export-hf or point it at a Hugging Face model directory")
        self.handles, self.where = [], {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types (SafetensorError, OSError)
                raise ConfigError(f"train.init_from: '{path}' is not a readable safetensors file ({e}); "
                                  "re-download or re-export it") from None
            self.handles.append(handle)
            self.where.update((name, handle) for name in handle.keys())
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def slice(self, name: str, full: tuple[int, ...], starts: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The [starts, starts + sizes) rectangle of tensor `name`, whose shape must be `full`."""
        if name not in self.where:
            raise ConfigError(f"train.init_from='{self.dir}': tensor '{name}' is missing; the directory "
                              "does not match its config.json (re-export or re-download it)")
        part = self.where[name].get_slice(name)
        shape = tuple(part.get_shape())
        if shape != tuple(full):
            raise ConfigError(f"train.init_from='{self.dir}': tensor '{name}' has shape {list(shape)} but the "
                              f"model needs {list(full)}; the weights do not match config.json")
        out = part[tuple(slice(s, s + n) for s, n in zip(starts, sizes, strict=True))]
        self.bytes_read += out.numel() * out.element_size()
        return out


def _expert_slice(src: HFTensors, cfg, layer: int, which: str, full, offsets, local) -> torch.Tensor:
    """This rank's piece of experts.w_gate_up [E, D, 2, F] or experts.w_down [E, F, D]."""
    e0, n, big_e = offsets[0], local[0], full[0]
    per_expert = expert_names(cfg, layer, 0)[0] in src
    if per_expert and expert_names(cfg, layer, big_e)[0] in src:
        raise ConfigError(f"train.init_from='{src.dir}': layer {layer} has more than model.num_experts="
                          f"{big_e} experts; the weights do not match config.json")
    if which == "w_gate_up":  # [L, D, 2, f] from gate/up [F, D] rows [f0, f0 + f)
        (d0, _, f0), (d, _, f), (big_d, _, big_f) = offsets[1:], local[1:], full[1:]
        if not per_expert:
            gate_up = fused_expert_names(layer)[0]  # [E, 2F, D]: gate rows, then up rows
            parts = [src.slice(gate_up, (big_e, 2 * big_f, big_d), (e0, half * big_f + f0, d0), (n, f, d))
                     for half in (0, 1)]
            return torch.stack(parts, 2).permute(0, 3, 2, 1)  # [L, f, 2, D] -> [L, D, 2, f]
        pieces = []
        for e in range(e0, e0 + n):
            gate, up, _ = expert_names(cfg, layer, e)
            pieces.append(torch.stack([src.slice(w, (big_f, big_d), (f0, d0), (f, d)).t() for w in (gate, up)], 1))
        return torch.stack(pieces)
    (f0, d0), (f, d), (big_f, big_d) = offsets[1:], local[1:], full[1:]  # w_down [L, f, D] from down [D, F]
    if not per_expert:
        down = fused_expert_names(layer)[1]
        return src.slice(down, (big_e, big_d, big_f), (e0, d0, f0), (n, d, f)).transpose(1, 2)
    return torch.stack([src.slice(expert_names(cfg, layer, e)[2], (big_d, big_f), (d0, f0), (d, f)).t()
                        for e in range(e0, e0 + n)])


def _fused_slice(src: HFTensors, cfg, layer: int, name: str, full, offsets, local) -> torch.Tensor:
    """This rank's piece of a gpt-oss expert tensor: the down ones as stored; w_gate_up
    [L, d, 2, f] and b_gate_up [L, 2, f] from [.., 2F] with gate and up interleaved, where hidden
    units [f0, f0 + f) are the contiguous columns [2 f0, 2 (f0 + f))."""
    hf_name = dict(fused_pairs(cfg, layer))[name]
    if not name.endswith("gate_up"):
        return src.slice(hf_name, full, offsets, local)
    lead = len(full) - 2  # the dims before [2, F]
    piece = src.slice(hf_name, (*full[:lead], 2 * full[-1]), (*offsets[:lead], 2 * offsets[-1]),
                      (*local[:lead], 2 * local[-1]))
    return from_fused(name, piece)


def _read_piece(src: HFTensors, cfg, hf_of: dict, name: str, full, offsets, local) -> torch.Tensor:
    if name in hf_of:
        return src.slice(hf_of[name], full, offsets, local)
    parts = name.split(".")  # layers.{i}.ffn.experts.{w_gate_up|w_down|b_*} or router.expert_bias
    if parts[-2] == "experts" and family_of(cfg.hf_family).fused_experts:
        return _fused_slice(src, cfg, int(parts[1]), name, full, offsets, local)
    if parts[-2] == "experts":
        return _expert_slice(src, cfg, int(parts[1]), parts[-1], full, offsets, local)
    if name.endswith("router.expert_bias"):  # the aux-loss-free bias is ours alone: HF routes with none
        return torch.zeros(local, dtype=torch.float32)
    raise ConfigError(f"train.init_from: the model's tensor '{name}' has no Hugging Face name in family "
                      f"{cfg.hf_family}")


def load_hf_sharded(model: torch.nn.Module, hf_dir: str | Path, device: torch.device | str = "cpu") -> int:
    """Fill a parallelized `model` (parameters possibly on the meta device: they are allocated
    on `device` here) with the slices this rank holds, read from `hf_dir`; returns the bytes read."""
    from longctx_moe.checkpoint.sharded_state import global_slices

    cfg = model.cfg
    try:
        check_expressible(cfg)
    except ValueError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    hf_of = dict(name_pairs(cfg))
    if cfg.tie_embeddings:
        hf_of.pop("lm_head.weight", None)
    src = HFTensors(hf_dir)
    slices = global_slices(model)
    materialize(model, device)
    with torch.no_grad():  # piece by piece into the parameters: one piece in flight at a time
        for name, t in model.state_dict().items():
            t.copy_(_read_piece(src, cfg, hf_of, name, *slices[name], tuple(t.shape)))
    return src.bytes_read


def materialize(model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
    """Give every meta parameter and buffer real (uninitialised) storage on `device` in place: the
    objects, and what parallelization set on them (declared splits, reduce_axis...), stay the same."""
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is None or not t.is_meta:
                continue
            tags = dict(t.__dict__)
            real = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                real = torch.nn.Parameter(real, requires_grad=t.requires_grad)
            torch.utils.swap_tensors(t, real)
            t.__dict__.update(tags)


def load_hf_model(hf_dir: str | Path, overrides: list[str] | None = None) -> torch.nn.Module:
    """Our single-device model (fp32, eval) holding `hf_dir`'s weights; model.* from its
    config.json plus `overrides` (non-architecture keys, e.g. execution.attention_backend)."""
    from longctx_moe.build import model_of
    from longctx_moe.config import load_config

    cfg = load_config(None, [f"train.init_from={hf_dir}", *(overrides or [])])
    model = model_of(cfg, meta=True)
    load_hf_sharded(model, hf_dir)
    return model.eval()
