"""Weight export to rollout engines: the policy's weights as Hugging Face Qwen3-MoE tensors, in
byte-capped buckets, gathered across tensor and expert parallelism.

Names are those of a Qwen3-MoE checkpoint as inference engines load it (vLLM, SGLang, and
transformers' `from_pretrained`, which fuses them itself): `model.layers.{i}.self_attn.q_proj.weight`,
..., and one tensor per expert and projection with the expert's global id,
`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [F, D], `up_proj` [F, D], `down_proj` [D, F].
An expert's three tensors always travel in one bucket (engines load an expert as a unit), and a
bucket holds whole tensors only; MoE sync time is set by the number of tensors as much as by bytes,
which is why they travel in buckets rather than one by one.

Every rank of the trainer takes part (each bucket is assembled with collectives over tp, ep and
etp: an expert's hidden units split over etp are concatenated along `etp_dim` first) and
every rank yields every bucket, so an engine colocated with any rank can load from it; a sink that
feeds one engine should push from one rank.

An export may be left early (a driver that stops reading): after each bucket the ranks vote
(one all-reduce of a flag) on going on, so a rank whose iterator is closed, or dropped and then
settled at its policy's next call (`ExportGate`), stops its peers at the same bucket; their next
read raises a one-line ExportAbandoned and every rank can make its next call. Closing releases
the gathered tensors the suspended export holds.

Legend: E experts (global), L local experts of an EP rank, D hidden, F expert hidden.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longctx_moe.hf_interop import _check_supported, _name_map

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _expert_specs(cfg, layer: int, dtype) -> list[TensorSpec]:
    d, f = cfg.hidden_size, cfg.expert_hidden_size
    base = f"model.layers.{layer}.mlp.experts"
    return [TensorSpec(f"{base}.{e}.{name}.weight", shape, dtype)
            for e in range(cfg.num_experts)
            for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f)))]


def _units(model, dtype) -> list[tuple[str, list[TensorSpec]]]:
    """The non-expert part of the export in order: (our parameter name, its HF tensor spec).
    Experts follow, layer by layer, one unit of three tensors per expert (_layer_experts)."""
    cfg = model.cfg
    _check_supported(cfg)
    params = dict(model.named_parameters())
    units = []
    for ours, hf, _ in _name_map(cfg):
        if ".experts." in ours:
            continue
        shape = _global_shape(params[ours], cfg, ours)
        units.append((ours, [TensorSpec(hf, shape, dtype)]))
    return units


def _global_shape(p: torch.nn.Parameter, cfg, name: str) -> tuple[int, ...]:
    shape = list(p.shape)
    if getattr(p, "tp_sharded", False):
        shape[p.tp_dim] = _full_size(cfg, name, p.tp_dim)
    return tuple(shape)


def _full_size(cfg, name: str, dim: int) -> int:
    """The unsharded size along a TP-sharded dimension, from the config (no communication)."""
    h, g, r = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if name in ("embed.weight", "lm_head.weight"):  # the vocab-parallel embedding and head
        return cfg.vocab_size
    if name.endswith(("attn.wq.weight", "attn.wo.weight")):
        return h * r
    if name.endswith(("attn.wk.weight", "attn.wv.weight")):
        return g * r
    if ".ffn.shared." in name:  # a shared expert: TP-sharded like a dense SwiGLU, its own width
        return cfg.shared_expert_hidden_size
    return cfg.dense_hidden_size  # a dense SwiGLU's hidden units


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
    return _gather_along(p, dims, "tp", p.tp_dim if getattr(p, "tp_sharded", False) else None)


def _gather_ep(p: torch.Tensor, dims) -> torch.Tensor:
    """[L, ...] expert slices of every EP rank -> [E, ...] in global expert order."""
    return _gather_along(p, dims, "ep", 0)


def _gather_etp(p: torch.Tensor, dims) -> torch.Tensor:
    """An expert weight whose hidden units are split over etp -> all of them (etp rank r holds
    the r-th slice along `etp_dim`, expert_parallel.shard_expert_hidden)."""
    return _gather_along(p, dims, "etp", getattr(p, "etp_dim", None))


def _layer_experts(model, layer: int, dims, dtype) -> list[list[tuple[str, torch.Tensor]]]:
    """One layer's experts as units [(name, tensor) x 3] per global expert id."""
    experts = model.layers[layer].ffn.experts
    w_gate_up_ED2F = _gather_ep(_gather_etp(experts.w_gate_up, dims), dims)
    w_down_EFD = _gather_ep(_gather_etp(experts.w_down, dims), dims)
    f = w_down_EFD.shape[1]
    base = f"model.layers.{layer}.mlp.experts"
    units = []
    for e in range(w_down_EFD.shape[0]):
        gate_up_2FD = w_gate_up_ED2F[e].flatten(1).t()
        units.append([(f"{base}.{e}.gate_proj.weight", gate_up_2FD[:f].to(dtype).contiguous()),
                      (f"{base}.{e}.up_proj.weight", gate_up_2FD[f:].to(dtype).contiguous()),
                      (f"{base}.{e}.down_proj.weight", w_down_EFD[e].t().to(dtype).contiguous())])
    return units


def _all_units(model, dims, dtype) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Units of whole tensors in export order, gathered (collective on every rank)."""
    params = dict(model.named_parameters())
    for ours, specs in _units(model, dtype):
        yield [(specs[0].name, _gather_tp(params[ours], dims).to(dtype).contiguous())]
    for layer in range(model.cfg.first_k_dense, model.cfg.num_layers):
        yield from _layer_experts(model, layer, dims, dtype)


def export_weights(model, dims, bucket_bytes: int, dtype: torch.dtype = torch.bfloat16,
                   gate: ExportGate | None = None) -> WeightExport:
    """Buckets of (HF name, tensor) of at most `bucket_bytes` bytes each (collective). `gate`:
    the policy's, which settles an export left open before the policy's next collective call."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    gate = gate or ExportGate()
    gate.settle()
    return gate.track(WeightExport(_buckets(model, dims, bucket_bytes, dtype), gate))


def _buckets(model, dims, bucket_bytes: int, dtype: torch.dtype) -> Iterator[Bucket]:
    bucket, size = [], 0
    with torch.no_grad():
        for unit in _all_units(model, dims, dtype):
            nbytes = sum(t.numel() * t.element_size() for _, t in unit)
            if nbytes > bucket_bytes:
                raise ValueError(f"{unit[0][0]} needs {nbytes} bytes with the tensors that travel "
                                 f"with it, over bucket_bytes={bucket_bytes}; raise bucket_bytes")
            if size + nbytes > bucket_bytes and bucket:
                yield bucket
                bucket, size = [], 0
            bucket += unit
            size += nbytes
    if bucket:
        yield bucket


class ExportAbandoned(RuntimeError):
    """Another rank left the export early: the message is one line."""


def _all_go_on(go: bool) -> bool:
    """Collective over every rank: whether all of them go on."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return go
    flag = torch.tensor([int(go)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class WeightExport:
    """The buckets of one export, in order, with a vote after each (see the module docstring).
    `stop` (set from any thread, e.g. a Ray driver's request) ends it at the next vote."""

    def __init__(self, buckets: Iterator[Bucket], gate: ExportGate):
        self._buckets, self._gate, self._sent = buckets, gate, 0
        self._open = False  # a bucket was handed out and its vote is still to come
        self.stop = threading.Event()

    def __iter__(self) -> WeightExport:
        return self

    def __next__(self) -> Bucket:
        if self._buckets is None:
            raise StopIteration
        if self._open and not _all_go_on(not self.stop.is_set()):
            self._release()
            if self.stop.is_set():
                raise StopIteration
            raise ExportAbandoned(f"export_weights stopped after bucket {self._sent}: another rank left the "
                                  "export early; call export_weights again on every rank for all buckets")
        try:
            bucket = next(self._buckets)
        except StopIteration:
            self._release()
            raise
        self._open, self._sent = True, self._sent + 1
        return bucket

    def send(self, value: None) -> Bucket:
        """As a generator's: lets a generator delegate to this export with `yield from`."""
        return next(self)

    def close(self) -> None:
        """Leave the export now (collective with the peers' next read): stops them at this bucket."""
        if self._open:
            _all_go_on(False)
        self._release()

    def _release(self) -> None:
        self._gate.sent = self._sent
        if self._buckets is not None:
            self._buckets.close()  # drops the gathered tensors the suspended generator holds
        self._buckets, self._open = None, False

    def __del__(self) -> None:
        # Dropped mid-export: release now, vote at the policy's next call (a deterministic point,
        # unlike garbage collection).
        if self._open:
            self._gate.owed = True
        self._release()


class ExportGate:
    """A policy's latest export: `settle()`, called before each of the policy's collective calls,
    closes it if it is still open and casts the vote a dropped one owes."""

    def __init__(self):
        self._latest: Callable[[], WeightExport | None] = lambda: None
        self.owed = False
        self.sent = 0  # buckets the last ended export handed out

    def track(self, export: WeightExport) -> WeightExport:
        self._latest = weakref.ref(export)
        return export

    def settle(self) -> None:
        export = self._latest()
        if export is not None:
            export.close()
        if self.owed:
            self.owed = False
            _all_go_on(False)

    def stop(self) -> None:
        """End the open export at its next vote (thread-safe: a Ray control call)."""
        export = self._latest()
        if export is not None:
            export.stop.set()


def push_weights(model, dims, sink: Callable[[Bucket], None], bucket_bytes: int,
                 dtype: torch.dtype = torch.bfloat16, gate: ExportGate | None = None) -> dict[str, float]:
    """Stream every bucket to `sink`; returns {buckets, tensors, bytes}."""
    stats = {"buckets": 0, "tensors": 0, "bytes": 0}
    for bucket in export_weights(model, dims, bucket_bytes, dtype, gate):
        sink(bucket)
        stats["buckets"] += 1
        stats["tensors"] += len(bucket)
        stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
    return stats
