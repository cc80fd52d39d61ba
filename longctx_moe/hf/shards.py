"""The model's weights by shard: each rank's own pieces of the Hugging Face tensors that hf.weights
exports whole, every element of every tensor yielded by exactly one rank, with no communication.

A rank holds one block of each HF tensor: the slice that tensor / expert parallelism left it (TP:
rows or columns of a projection, ETP: a range of an expert's hidden units, EP: whole experts), and
the ranks holding the same block (its replicas over DP, CP and EDP) hold the same values. The plan
hands each block to its holders once:

- an expert's tensors (gate, up and down, one HF name each, or their ETP slices) are a unit that
  one holder yields whole (engines load an expert as a unit; per-expert HF names are whole tensors);
- any other block is cut along its first dim into at most one chunk per holder, as many chunks as
  keep each under 1/SPREAD of a rank's fair share (model elements / world): the embedding spreads
  over all its holders, a norm weight stays whole;
- largest first, each unit or chunk goes to its least-loaded holder(s) (ties: the lower rank), so
  every rank's bytes stay near model bytes / world, within about one indivisible unit.

The plan is a pure function of the layout (ParallelDims) and the splits the parallelizers declared
(parallel/sharding.py): every rank computes the same plan, and a rank yields at most one piece of
each HF tensor, in export order (weights_spec).

Record format (`ShardRecord`, one per piece): `hf_name` (the names of hf.weights), `full_shape`
(the whole HF tensor's shape), `dtype`, `slices` ((start, stop) per dim of the HF tensor, whole
dims included) and `tensor` = whole[slices]. `reassemble` rebuilds the whole tensors from every
rank's records and checks that each element came exactly once.

Legend: L local experts of an EP rank, D hidden, F expert hidden.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from longctx_moe.hf.families import family_of
from longctx_moe.hf.interop import expert_names, fused_pairs, name_pairs, to_fused
from longctx_moe.hf.weights import TensorSpec, weights_spec
from longctx_moe.parallel.sharding import splits_of

# A cut chunk of a replicated block is at most 1/SPREAD of a rank's fair share: the bytes a rank
# yields stay within the fair share plus about one such chunk (or one expert unit).
SPREAD = 16

Slices = tuple[tuple[int, int], ...]  # (start, stop) per dim of an HF tensor


@dataclass(frozen=True)
class ShardRecord:
    """One piece of one HF tensor: `tensor` is whole[slices] of the HF tensor `hf_name` of shape
    `full_shape`, in `dtype` (`slices`: one (start, stop) per dim; whole dims are (0, size)).

    The tensor shares storage with the parameter where no cast or transpose was needed (a float32
    export of float32 rows): copy it if it must outlive the next update."""

    hf_name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    slices: Slices
    tensor: torch.Tensor

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(start for start, _ in self.slices)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def index(self) -> tuple[slice, ...]:
        """`whole[record.index()]` is the record's piece."""
        return tuple(slice(start, stop) for start, stop in self.slices)


@dataclass(frozen=True)
class Source:
    """Where an HF tensor comes from on each rank: our tensor `ours`, how a rank's piece of it
    becomes its block of the HF tensor (`layout`, see _to_hf), and the HF dim each of our dims a
    split may cut becomes (`dims`: (our dim, HF dim) pairs). `expert`: the global expert id of a
    per-expert HF tensor (EP picks the ranks that hold it, not a slice); `unit`: tensors with the
    same unit travel together."""

    spec: TensorSpec
    ours: str
    layout: str  # "same" | "gate" | "up" | "down" | "fused"
    dims: tuple[tuple[int, int], ...]
    unit: int
    expert: int | None = None


@dataclass(frozen=True)
class Piece:
    """An entry of the plan: the piece `slices` of source `source`'s HF tensor, yielded by rank
    `owner`, cut from the block `block` that rank holds."""

    source: int
    slices: Slices
    block: Slices
    owner: int

    @property
    def numel(self) -> int:
        return math.prod(stop - start for start, stop in self.slices)


@dataclass(frozen=True)
class ShardPlan:
    """Every rank's pieces (`pieces[rank]`), computed alike on every rank."""

    sources: list[Source]  # in export order
    pieces: list[list[Piece]]  # per rank, in export order
    total: int  # elements of the whole model

    def numel(self, rank: int) -> int:
        return sum(p.numel for p in self.pieces[rank])


def _identity(ndim: int) -> tuple[tuple[int, int], ...]:
    return tuple((d, d) for d in range(ndim))


def sources(model) -> list[Source]:
    """Every HF tensor of the export, in export order, with where it comes from (no communication)."""
    cfg = model.cfg
    specs = {s.name: s for s in weights_spec(model, torch.float32)}
    out = [Source(specs[hf], ours, "same", _identity(len(specs[hf].shape)), i)
           for i, (ours, hf) in enumerate(name_pairs(cfg))]
    for layer in range(cfg.first_k_dense, cfg.num_layers):
        if family_of(cfg.hf_family).fused_experts:  # gpt-oss: [E, ...] per layer, gate/up interleaved
            for ours, hf in fused_pairs(cfg, layer):
                ndim = len(specs[hf].shape) + ours.endswith("gate_up")
                # our [.., 2, F] becomes [.., 2F]: an F range p*u.. becomes the range 2pu.. (to_fused)
                dims = _identity(ndim - 2) + ((ndim - 1, ndim - 2),) if ours.endswith("gate_up") else _identity(ndim)
                out.append(Source(specs[hf], ours, "fused", dims, len(out)))
            continue
        base = f"layers.{layer}.ffn.experts."
        for e in range(cfg.num_experts):
            unit = len(out)
            gate, up, down = expert_names(cfg, layer, e)
            # w_gate_up [L, D, 2, F] -> gate / up [F, D]; w_down [L, F, D] -> down [D, F]
            out += [Source(specs[gate], base + "w_gate_up", "gate", ((3, 0), (1, 1)), unit, e),
                    Source(specs[up], base + "w_gate_up", "up", ((3, 0), (1, 1)), unit, e),
                    Source(specs[down], base + "w_down", "down", ((1, 1), (2, 0)), unit, e)]
    return out


def _to_hf(src: Source, p: torch.Tensor) -> torch.Tensor:
    """This rank's piece `p` of our tensor as its block of the HF tensor (a view where it can be)."""
    if src.layout == "same":
        return p
    if src.layout == "fused":
        return to_fused(src.ours, p)
    local = src.expert % p.shape[0]  # the rank holds experts [r L, (r+1) L)
    if src.layout == "down":
        return p[local].t()
    return p[local, :, 0 if src.layout == "gate" else 1, :].t()


def _blocks(src: Source, p: torch.Tensor) -> Iterator[tuple[dict[str, int], Slices]]:
    """Every block of src's HF tensor: (the coordinate its holders have on each mesh axis, its
    slices). Built from this rank's splits, which every rank shares but for the index."""
    hf_dim = dict(src.dims)
    fixed, cut = {}, []
    for s in splits_of(p):
        if src.expert is not None and s.axis == "ep":  # whole experts: the EP rank that has it
            fixed["ep"] = src.expert // p.shape[0]
        elif s.dim in hf_dim:
            cut.append(s)
        else:
            raise ValueError(f"{src.ours} is split over {s.axis} along dim {s.dim}, which the shard "
                             f"export of {src.spec.name} does not map; export it whole (export_weights)")
    for idx in itertools.product(*(range(s.parts) for s in cut)):
        slices = [(0, n) for n in src.spec.shape]
        for s, i in zip(cut, idx, strict=True):
            d = hf_dim[s.dim]
            n = src.spec.shape[d] // s.parts
            slices[d] = (i * n, (i + 1) * n)
        yield {**fixed, **{s.axis: i for s, i in zip(cut, idx, strict=True)}}, tuple(slices)


@dataclass
class _Unit:
    order: int
    holders: tuple[int, ...]
    parts: list[tuple[int, Slices]]  # (source index, block slices)
    divisible: bool

    @property
    def numel(self) -> int:
        return sum(math.prod(b - a for a, b in sl) for _, sl in self.parts)


def _units(srcs: list[Source], tensors: dict[str, torch.Tensor], dims) -> list[_Unit]:
    """Every block of every source with its holders; an expert's blocks of the same coordinate
    make one indivisible unit."""
    axes = ("tp", "ep", "etp")
    coords = {a: [dims.rank_in(a, r) for r in range(dims.world_size)] for a in axes}
    holders_of: dict[tuple, tuple[int, ...]] = {}
    units: dict[tuple, _Unit] = {}
    rank = 0 if dims.world_size == 1 else dims.rank
    for i, src in enumerate(srcs):
        p = tensors[src.ours]
        for s in splits_of(p):  # the plan takes rank r's slice to be the r-th of its group
            if s.index != coords[s.axis][rank]:
                raise ValueError(f"{src.ours} holds slice {s.index} over {s.axis} on a rank at "
                                 f"position {coords[s.axis][rank]}; the shard export needs them equal")
        for coord, block in _blocks(src, p):
            key = tuple(sorted(coord.items()))
            if key not in holders_of:
                holders_of[key] = tuple(r for r in range(dims.world_size)
                                        if all(coords[a][r] == c for a, c in coord.items()))
            unit = units.setdefault((src.unit, key), _Unit(len(units), holders_of[key], [], src.expert is None))
            unit.parts.append((i, block))
    return list(units.values())


def _row_cuts(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) in n near-equal consecutive ranges."""
    edges = [start + (stop - start) * k // n for k in range(n + 1)]
    return list(itertools.pairwise(edges))


def _chunks(unit: _Unit, cap: int) -> int:
    """How many holders share a unit: one for an expert's or a scalar's, else as many as keep
    each chunk under `cap` elements, at most one per holder and per row."""
    if not unit.divisible or not unit.parts[0][1]:
        return 1
    start, stop = unit.parts[0][1][0]
    return max(1, min(len(unit.holders), stop - start, math.ceil(unit.numel / cap)))


def shard_plan(model, dims) -> ShardPlan:
    """Which rank yields which piece of every HF tensor (module docstring); pure, the same on
    every rank. `dims`: the model's ParallelDims, with this rank set (build_groups)."""
    srcs = sources(model)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    units = _units(srcs, tensors, dims)
    total = sum(u.numel for u in units)
    cap = max(1, total // (dims.world_size * SPREAD))
    load = [0] * dims.world_size
    pieces: list[list[Piece]] = [[] for _ in range(dims.world_size)]
    for unit in sorted(units, key=lambda u: (-u.numel, u.order)):
        n = _chunks(unit, cap)
        chosen = sorted(sorted(unit.holders, key=lambda r: (load[r], r))[:n])
        if n == 1:
            pieces[chosen[0]] += [Piece(i, block, block, chosen[0]) for i, block in unit.parts]
            load[chosen[0]] += unit.numel
            continue
        (i, block), = unit.parts
        for r, rows in zip(chosen, _row_cuts(*block[0], n), strict=True):
            piece = Piece(i, (rows, *block[1:]), block, r)
            pieces[r].append(piece)
            load[r] += piece.numel
    for mine in pieces:
        mine.sort(key=lambda p: p.source)
    return ShardPlan(srcs, pieces, total)


def export_shards(model, dims, dtype: torch.dtype = torch.bfloat16) -> Iterator[ShardRecord]:
    """This rank's pieces of the HF tensors as ShardRecords, in export order (no communication:
    the rank may stop reading at any point). Read it to the end before the next update, or the
    later records hold the updated weights."""
    plan = shard_plan(model, dims)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    rank = 0 if dims.world_size == 1 else dims.rank
    with torch.no_grad():
        for piece in plan.pieces[rank]:
            src = plan.sources[piece.source]
            t = _to_hf(src, tensors[src.ours].detach())
            if tuple(t.shape) != tuple(b - a for a, b in piece.block):
                raise RuntimeError(f"{src.spec.name}: this rank's block is {tuple(t.shape)}, the plan "
                                   f"expects {piece.block}; the declared splits and the export disagree")
            for d, ((a, b), (a0, _)) in enumerate(zip(piece.slices, piece.block, strict=True)):
                t = t.narrow(d, a - a0, b - a)
            yield ShardRecord(src.spec.name, src.spec.shape, dtype, piece.slices, t.to(dtype).contiguous())


def reassemble(records: Iterable[ShardRecord], specs: Iterable[TensorSpec] | None = None) -> dict[str, torch.Tensor]:
    """The whole HF tensors from the records of every rank (any order), checked: every element
    came exactly once, and records of one name agree on shape and dtype; with `specs`
    (weights_spec), exactly its tensors are there, in its order. ValueError (one line) otherwise."""
    whole: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for r in records:
        if r.hf_name not in whole:
            whole[r.hf_name] = torch.empty(r.full_shape, dtype=r.dtype, device=r.tensor.device)
            seen[r.hf_name] = torch.zeros(r.full_shape, dtype=torch.bool, device=r.tensor.device)
        out, got = whole[r.hf_name], seen[r.hf_name]
        if tuple(out.shape) != tuple(r.full_shape) or out.dtype != r.dtype or r.tensor.dtype != r.dtype:
            raise ValueError(f"{r.hf_name}: a record says {tuple(r.full_shape)} {r.dtype} (tensor "
                             f"{r.tensor.dtype}), another {tuple(out.shape)} {out.dtype}; mixed exports")
        if tuple(r.tensor.shape) != tuple(b - a for a, b in r.slices):
            raise ValueError(f"{r.hf_name}: tensor {tuple(r.tensor.shape)} does not fill slices {r.slices}")
        if bool(got[r.index()].any()):
            raise ValueError(f"{r.hf_name}: slices {r.slices} overlap another record's; pass each "
                             "rank's records of one export once")
        got[r.index()] = True
        out[r.index()] = r.tensor
    for name, got in seen.items():
        if not bool(got.all()):
            raise ValueError(f"{name}: {int((~got).sum())} of {got.numel()} elements are in no record; "
                             "pass the records of every rank")
    if specs is None:
        return whole
    names = [s.name for s in specs]
    missing, extra = [n for n in names if n not in whole], set(whole) - set(names)
    if missing:
        raise ValueError(f"{len(missing)} tensors have no record ({missing[0]}, ...); pass the records of every rank")
    if extra:
        raise ValueError(f"records of {sorted(extra)[0]} (and {len(extra) - 1} more), which specs do not "
                         "name; pass the specs of the same model")
    return {n: whole[n] for n in names}
