"""The model's weights as Hugging Face tensors of the model's family (model.hf_family), in byte-capped buckets, gathered across
tensor and expert parallelism: what rollout engines load (rl_hooks.export pushes them) and what
`longctx-moe export-hf` writes as shards.

Names are those of the family's checkpoints as inference engines load them (vLLM, SGLang, and
transformers' `from_pretrained`, which fuses them itself): `model.layers.{i}.self_attn.q_proj.weight`,
..., and one tensor per expert and projection with the expert's global id,
`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [F, D], `up_proj` [F, D], `down_proj` [D, F]
(Mixtral: `block_sparse_moe.experts.{e}.w1|w3|w2`; hf/families.py holds each family's names).
(gpt-oss: each layer's fused `mlp.experts.gate_up_proj`, `gate_up_proj_bias`, `down_proj`,
`down_proj_bias`, each tensor a unit of its own, as its checkpoints and engines have them.)
An expert's three tensors always travel in one bucket (engines load an expert as a unit), and a
bucket holds whole tensors only; MoE sync time is set by the number of tensors as much as by bytes,
which is why they travel in buckets rather than one by one.

Every rank of the trainer takes part (each bucket is assembled with collectives over tp, ep and
etp: an expert's hidden units split over etp are concatenated along their declared `etp` split
first) and every rank yields every bucket, so an engine colocated with any rank can load from it; a sink that
feeds one engine should push from one rank.

Legend: E experts (global), L local experts of an EP rank, D hidden, F expert hidden.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longctx_moe.hf.families import family_of
from longctx_moe.hf.interop import _check_supported, expert_names, fused_pairs, name_pairs, to_fused
from longctx_moe.parallel.sharding import split_dim

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _expert_specs(cfg, layer: int, dtype) -> list[TensorSpec]:
    d, f, e = cfg.hidden_size, cfg.expert_hidden_size, cfg.num_experts
    if family_of(cfg.hf_family).fused_experts:  # gpt-oss: the layer's experts as single tensors
        shapes = {"w_gate_up": (e, d, 2 * f), "b_gate_up": (e, 2 * f), "w_down": (e, f, d), "b_down": (e, d)}
        return [TensorSpec(hf, shapes[ours.rsplit(".", 1)[1]], dtype) for ours, hf in fused_pairs(cfg, layer)]
    return [TensorSpec(name, shape, dtype)
            for e in range(cfg.num_experts)
            for name, shape in zip(expert_names(cfg, layer, e), ((f, d), (f, d), (d, f)), strict=True)]


def _units(model, dtype) -> list[tuple[str, list[TensorSpec]]]:
    """The non-expert part of the export in order: (our state-dict name, its HF tensor spec).
    Global shapes come from the splits the parallelizers declared (checkpoint.sharded_state.
    global_slices). Experts follow, layer by layer, one unit of three tensors per expert
    (_layer_experts)."""
    from longctx_moe.checkpoint.sharded_state import global_slices

    cfg = model.cfg
    _check_supported(cfg)
    slices = global_slices(model)
    return [(ours, [TensorSpec(hf, slices[ours][0], dtype)]) for ours, hf in name_pairs(cfg)]


def weights_spec(model, dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """Every exported tensor's name, global shape and dtype, in export order (no communication)."""
    cfg = model.cfg
    specs = [s for _, unit in _units(model, dtype) for s in unit]
    for layer in range(cfg.first_k_dense, cfg.num_layers):
        specs += _expert_specs(cfg, layer, dtype)
    return specs


def _gather_along(p: torch.Tensor, dims, axis: str, dim: int | None) -> torch.Tensor:
    """The whole of a tensor whose rank r of the `axis` group holds the r-th slice along `dim`
    (None, or a group of one: `p` is whole already)."""
    if dim is None or dims.size(axis) == 1:
        return p.detach()
    parts = [torch.empty_like(p) for _ in range(dims.size(axis))]
    dist.all_gather(parts, p.detach().contiguous(), group=dims.group(axis))
    return torch.cat(parts, dim=dim)


def _gather_tp(p: torch.Tensor, dims) -> torch.Tensor:
    return _gather_along(p, dims, "tp", split_dim(p, "tp"))


def _gather_ep(p: torch.Tensor, dims) -> torch.Tensor:
    """[L, ...] expert slices of every EP rank -> [E, ...] in global expert order."""
    return _gather_along(p, dims, "ep", 0)


def _gather_etp(p: torch.Tensor, dims) -> torch.Tensor:
    """An expert weight whose hidden units are split over etp -> all of them (etp rank r holds
    the r-th slice along its declared `etp` split, expert_parallel.shard_expert_hidden)."""
    return _gather_along(p, dims, "etp", split_dim(p, "etp"))


def _layer_experts(model, layer: int, dims, dtype) -> list[list[tuple[str, torch.Tensor]]]:
    """One layer's experts as units [(name, tensor) x 3] per global expert id."""
    experts = model.layers[layer].ffn.experts
    if family_of(model.cfg.hf_family).fused_experts:  # gpt-oss: one unit per whole tensor
        return [[(hf, to_fused(ours, _gather_ep(_gather_etp(getattr(experts, ours.rsplit(".", 1)[1]), dims),
                                                dims)).to(dtype).contiguous())]
                for ours, hf in fused_pairs(model.cfg, layer)]
    w_gate_up_ED2F = _gather_ep(_gather_etp(experts.w_gate_up, dims), dims)
    w_down_EFD = _gather_ep(_gather_etp(experts.w_down, dims), dims)
    f = w_down_EFD.shape[1]
    units = []
    for e in range(w_down_EFD.shape[0]):
        gate_up_2FD = w_gate_up_ED2F[e].flatten(1).t()
        gate, up, down = expert_names(model.cfg, layer, e)
        units.append([(gate, gate_up_2FD[:f].to(dtype).contiguous()),
                      (up, gate_up_2FD[f:].to(dtype).contiguous()),
                      (down, w_down_EFD[e].t().to(dtype).contiguous())])
    return units


def _all_units(model, dims, dtype) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Units of whole tensors in export order, gathered (collective on every rank)."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for ours, specs in _units(model, dtype):
        yield [(specs[0].name, _gather_tp(tensors[ours], dims).to(dtype).contiguous())]
    for layer in range(model.cfg.first_k_dense, model.cfg.num_layers):
        yield from _layer_experts(model, layer, dims, dtype)


def export_weights(model, dims, bucket_bytes: int, dtype: torch.dtype = torch.bfloat16) -> Iterator[Bucket]:
    """Buckets of (HF name, tensor) of at most `bucket_bytes` bytes each (collective), except that
    a tensor larger than that (with the tensors that travel with it) goes alone in a bucket of its
    own: it is gathered whole anyway, and a cap below a model's largest tensor (a 150K-vocabulary
    embedding is 0.6-1.7 GB in bf16) would otherwise make the default fail on the models people
    train."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    bucket, size = [], 0
    with torch.no_grad():
        for unit in _all_units(model, dims, dtype):
            nbytes = sum(t.numel() * t.element_size() for _, t in unit)
            if size + nbytes > bucket_bytes and bucket:
                yield bucket
                bucket, size = [], 0
            bucket += unit
            size += nbytes
    if bucket:
        yield bucket
