"""PackedBatch: the contract between the loaders and the trainer (one micro-batch on one rank).

Layout (THD, no batch dimension): documents lie one after another in a flat token axis of
physical length T. Document i occupies physical positions
[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i), where len_i = cu_seqlens[i+1] - cu_seqlens[i];
the rest of its padded slot, up to cu_seqlens_padded[i+1], is padding (present only when documents
are padded to the CP/TP multiple). Padding is never counted in `cu_seqlens`.

The document bounds (cu_seqlens, cu_seqlens_padded, max_seqlen) live on the host, where the loader
made them, for the whole life of the batch: `to(device)` moves the per-token tensors only. Every
plan made from them (attention segments, CP placement, Dynamic-CP exchange) then reads host values,
so a GPU step pays no device-to-host sync for them and a rehearsal on `meta` tensors can read them.

Shapes: T physical tokens, N documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

IGNORE_INDEX = -100
_HOST_FIELDS = ("cu_seqlens", "cu_seqlens_padded")  # PackedBatch.to leaves these on the host


def pad_to(n, multiple: int):
    """Round n (int, or int array / tensor) up to a multiple of `multiple`: the one round-up."""
    return -(-n // multiple) * multiple


def pad_multiple(cp: int, tp: int, sequence_parallel: bool = False) -> int:
    """What every document's slot is padded to: lcm(2*CP, TP). The CP load-balanced (zigzag)
    split cuts a document into 2*CP equal chunks, and sequence-parallel TP splits it TP ways;
    CP=1 needs no chunks, so only TP counts there. With sequence parallelism each CP rank's
    share of a split document (slot / CP tokens) is split TP ways again: lcm(2*CP, CP*TP)."""
    return math.lcm(2 * cp if cp > 1 else 1, cp * tp if sequence_parallel else tp)


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # int64 [T]; pad id at padding positions
    labels: torch.Tensor  # int64 [T]; next token of the same document, IGNORE_INDEX where none
    cu_seqlens: torch.Tensor  # int32 [N+1], host; cumulative real document lengths
    cu_seqlens_padded: torch.Tensor  # int32 [N+1], host; physical offsets of the padded slots
    position_ids: torch.Tensor  # int64 [T]; 0.. per document (a split piece packed with
    # --split-positions continue starts at its offset in the document); 0 at padding
    max_seqlen: int  # host int: longest real document; never read it from a device tensor
    loss_weight: torch.Tensor | None = None  # float32 [T]; optional per-token weight

    def __post_init__(self) -> None:
        for name in _HOST_FIELDS:
            where = getattr(self, name).device
            if where.type != "cpu":
                raise ValueError(f"PackedBatch.{name} is on {where}; the document bounds stay on the "
                                 "host: build them there (PackedBatch.to moves only the token tensors)")

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_docs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def num_target_tokens(self) -> int:
        """Tokens that carry a loss; the trainer sums this over the whole optimizer step. Count
        it on the host batch, before `to(device)` (on device labels it is a sync)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def doc_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def document_ids(self) -> torch.Tensor:
        """int64 [T] on the host: each position's document index, -1 at padding (built from the
        host bounds, whatever device the tokens are on)."""
        cu, cup = self.cu_seqlens.long(), self.cu_seqlens_padded.long()
        lens_N, slots_N = cu.diff(), cup.diff()
        n = lens_N.numel()
        ids = torch.stack([torch.arange(n), torch.full((n,), -1)], 1).flatten()
        runs = torch.stack([lens_N, slots_N - lens_N], 1).flatten()
        ids_T = torch.repeat_interleave(ids, runs, output_size=int(cup[-1]))
        return torch.cat([ids_T, ids_T.new_full((self.num_tokens - ids_T.numel(),), -1)])

    def real_token_mask(self) -> torch.Tensor:
        """bool [T] on the host: True at real (non-padding) positions."""
        return self.document_ids() >= 0

    def to(self, device: torch.device | str) -> PackedBatch:
        """The per-token tensors on `device`; the document bounds stay on the host (see the
        module docstring)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value) and f.name not in _HOST_FIELDS:
                value = value.to(device, non_blocking=True)
            moved[f.name] = value
        return PackedBatch(**moved)

    def validate(self) -> None:
        """Raise ValueError naming the broken invariant. Loaders call it on the batches they build
        (18 us for a 4096-token micro-batch of ~4 documents, beside 79 us to build it). It reads
        the host bounds and the tensors' shapes only, so it costs no device sync anywhere."""
        t = self.num_tokens
        for name in ("labels", "position_ids"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"PackedBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected ({t},)")
        if self.cu_seqlens.shape != self.cu_seqlens_padded.shape:
            raise ValueError("PackedBatch.cu_seqlens and cu_seqlens_padded must have the same length")
        lens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        slots = self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]
        if (lens < 0).any() or (lens > slots).any():
            raise ValueError("PackedBatch: every document must fit its padded slot (0 <= len <= slot)")
        if int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens_padded[0]) != 0:
            raise ValueError("PackedBatch: cu_seqlens and cu_seqlens_padded must start at 0")
        if int(self.cu_seqlens_padded[-1]) > t:
            raise ValueError(f"PackedBatch: cu_seqlens_padded ends at {int(self.cu_seqlens_padded[-1])} > T={t}")
        longest = int(lens.max()) if lens.numel() else 0
        if self.max_seqlen < longest:
            raise ValueError(f"PackedBatch.max_seqlen={self.max_seqlen} < longest document {longest}")


def labels_from_tokens(tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                       cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """int64 [T]: the next token inside the same document; IGNORE_INDEX at each document's last
    token and at padding."""
    labels = torch.full_like(tokens, IGNORE_INDEX)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    for start, n in zip(cu_seqlens_padded[:-1].tolist(), lens, strict=True):
        if n > 1:
            labels[start:start + n - 1] = tokens[start + 1:start + n]
    return labels


def position_ids_from_cu(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                         total: int) -> torch.Tensor:
    """int64 [T]: 0..len-1 inside each document, 0 at padding."""
    pos = torch.zeros(total, dtype=torch.long)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    for start, n in zip(cu_seqlens_padded[:-1].tolist(), lens, strict=True):
        pos[start:start + n] = torch.arange(n)
    return pos


def pack_documents(tokens: list[torch.Tensor], labels: list[torch.Tensor], multiple: int, *,
                   positions: list[torch.Tensor] | None = None,
                   weights: list[torch.Tensor | None] | None = None, pad_id: int = 0) -> PackedBatch:
    """The one builder of a PackedBatch from documents (the loader, Dynamic-CP and the RL
    micro-batches use it): document i's real `tokens[i]` (int64 [n_i]) with `labels[i]` ([n_i],
    IGNORE_INDEX where no target) and `positions[i]` (default 0..n_i-1), padded to a multiple of
    `multiple` with `pad_id`, no target and position 0. `weights[i]` (float32 [n_i], or None for
    all ones) gives loss_weight, 0 at padding; no weights at all gives None.

    With no documents it is the stand-in batch: `multiple` padding tokens without targets, so an
    idle rank still runs the step's collectives and sequence parallelism can split its tokens."""
    if not tokens:
        pad = torch.full((multiple,), pad_id, dtype=torch.int64)
        return PackedBatch(tokens=pad, labels=torch.full_like(pad, IGNORE_INDEX),
                           cu_seqlens=torch.zeros(1, dtype=torch.int32),
                           cu_seqlens_padded=torch.zeros(1, dtype=torch.int32),
                           position_ids=torch.zeros(multiple, dtype=torch.int64), max_seqlen=0)
    lens = [t.numel() for t in tokens]
    slots = [pad_to(n, multiple) for n in lens]

    def padded(values, fill):
        return torch.cat([torch.cat([v, v.new_full((s - v.numel(),), fill)])
                          for v, s in zip(values, slots, strict=True)])

    if positions is None:
        positions = [torch.arange(n, dtype=torch.int64) for n in lens]
    weight = None
    if weights is not None and any(w is not None for w in weights):
        weight = padded([torch.ones(n) if w is None else w for w, n in zip(weights, lens, strict=True)], 0.0)
    batch = PackedBatch(tokens=padded(tokens, pad_id), labels=padded(labels, IGNORE_INDEX),
                        cu_seqlens=torch.tensor([0, *lens]).cumsum(0).to(torch.int32),
                        cu_seqlens_padded=torch.tensor([0, *slots]).cumsum(0).to(torch.int32),
                        position_ids=padded(positions, 0), max_seqlen=max(lens), loss_weight=weight)
    batch.validate()  # host tensors, so cheap: a layout bug fails here by name, not in a kernel
    return batch
