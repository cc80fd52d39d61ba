"""How a parallelized parameter is split over the mesh: the declaration that the parallelizers
write when they cut a parameter (tensor_parallel.py: `tp`; expert_parallel.py: `ep`, `etp`) and
that everything needing the whole tensor reads: the checkpoint (checkpoint/sharded_state.py), the
Hugging Face exporter (hf/weights.py) and the gradient reduction. It is the one owner of a
parameter's global shape and of where this rank's piece sits in it; nothing probes module
attributes or names for that.

A `Split(axis, dim, parts, index)`: along tensor dim `dim` the whole tensor is `parts` equal
slices, one per rank of the mesh axis `axis`, and this rank holds slice `index`. A parameter may
carry several splits on different dims (an expert weight: experts over ep along dim 0, hidden
units over etp along another).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTR = "mesh_splits"  # the parameter attribute holding its tuple of Splits


@dataclass(frozen=True)
class Split:
    axis: str  # mesh axis: "tp", "ep" or "etp"
    dim: int  # tensor dim that is cut
    parts: int  # equal slices along `dim`, one per rank of `axis`
    index: int  # the slice this rank holds


def splits_of(p: torch.Tensor) -> tuple[Split, ...]:
    """The splits declared on `p` (empty: `p` is whole on every rank)."""
    return getattr(p, _ATTR, ())


def declare_split(p: torch.Tensor, axis: str, dim: int, parts: int, index: int) -> None:
    """Record that `p` is slice `index` of `parts` along `dim` over mesh axis `axis`."""
    axis = getattr(axis, "value", axis)  # an Axis member or its name
    if not 0 <= index < parts:
        raise ValueError(f"declare_split: slice {index} of {parts} does not exist")
    if any(s.axis == axis or s.dim == dim for s in splits_of(p)):
        raise ValueError(f"declare_split: the parameter is already split over {axis} or along dim {dim}; "
                         "shard a freshly built model once")
    setattr(p, _ATTR, (*splits_of(p), Split(axis, dim, parts, index)))


def carry_splits(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give `dst` (a new Parameter replacing `src` in its module) the splits of `src`."""
    if splits_of(src):
        setattr(dst, _ATTR, splits_of(src))


def split_dim(p: torch.Tensor, axis: str) -> int | None:
    """The dim of `p` split over `axis`, or None."""
    return next((s.dim for s in splits_of(p) if s.axis == axis), None)


def global_slice(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets of this rank's piece in it) of parameter or buffer `p`."""
    full, offsets = list(p.shape), [0] * p.ndim
    for s in splits_of(p):
        full[s.dim], offsets[s.dim] = p.shape[s.dim] * s.parts, p.shape[s.dim] * s.index
    return tuple(full), tuple(offsets)
