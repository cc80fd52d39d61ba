"""Kernel calls of the CP schedule: which local queries see which keys at each ring step.

Each step is ONE varlen kernel call over all local queries [L] and all keys of the step's KV
block, described by (cu_q, cu_k, causal). Every query row appears in exactly one segment, so a
step yields at most one partial result per row and the merge stays a pairwise fold. Segments:
- (lq, lk) with both > 0: queries see keys (bottom-right causal, or full);
- (lq, 0): queries that see nothing at this step (padding, or no visible key): out 0, lse -inf;
- (0, lk): keys that no query of this step sees (padding, unused chunk): zero gradients.

Zigzag pieces of ring rank r hold chunks r and 2P-1-r of a document. Against the block of ring
rank s (chunks s and 2P-1-s of the same document):
- s == r: both chunks against both chunks, causal. Bottom-right alignment of the square
  [chunk r, chunk 2P-1-r] x [same] is exactly "key position <= query position".
- s < r: both local chunks see chunk s in full (it precedes both); chunk 2P-1-s comes after both,
  so rank r never needs the second chunks of a block from a lower rank (the ring exploits it).
- s > r: only chunk 2P-1-r sees anything, and it sees both chunks of s in full.
Padding is at the end of a slot, so the real tokens of every piece are a prefix of it and trimming
to the real prefix keeps the alignment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Piece:
    """A contiguous block of a rank's local layout: document `doc`, local tokens
    [local_start, local_start + length), the first `real` of them real; `phys_start` is the
    physical position of the first token of the block (zigzag: of its first chunk)."""

    doc: int
    local_start: int
    length: int
    real: int
    zigzag: bool
    phys_start: int


@dataclass(frozen=True)
class StepSpec:
    """One varlen kernel call: cu_q / cu_k int32 [n+1], host ints max_q / max_k; window and
    offset as in kernels.attn_forward (sliding-window steps, window_schedule.py)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    empty: bool  # no query sees any key: the kernel call can be skipped
    window: int | None = None
    offset: int = 0

    def to(self, device: torch.device) -> StepSpec:
        """The boundaries on `device` for the kernels (from the host plan: an asynchronous copy,
        never a stream sync); max_q / max_k stay host ints."""
        return replace(self, cu_q=self.cu_q.to(device, non_blocking=True),
                       cu_k=self.cu_k.to(device, non_blocking=True))


def _spec(segments: list[tuple[int, int]], causal: bool) -> StepSpec:
    segs = [(a, b) for a, b in segments if a or b]
    lq = [a for a, _ in segs]
    lk = [b for _, b in segs]
    cu_q = torch.tensor([0] + lq, dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lk, dtype=torch.int64).cumsum(0).to(torch.int32)
    empty = not any(a and b for a, b in segs)
    return StepSpec(cu_q, cu_k, max(lq, default=0), max(lk, default=0), causal, empty)


def _with_padding(real: int, length: int) -> list[tuple[int, int]]:
    """Segments of one piece seen against itself: its real prefix, then its padding isolated."""
    pad = length - real
    return [(real, real), (pad, 0), (0, pad)]


def diagonal_step(pieces: list[Piece], causal: bool) -> StepSpec:
    """Step 0: the local queries against the local keys (same layout on both sides)."""
    segs: list[tuple[int, int]] = []
    for p in pieces:
        segs += _with_padding(p.real, p.length)
    return _spec(segs, causal)


def full_sequence_step(cu: torch.Tensor, cu_pad: torch.Tensor) -> StepSpec:
    """All owned tokens in physical order, every document against itself (Ulysses), causal."""
    segs: list[tuple[int, int]] = []
    for length, slot in zip(cu.diff().tolist(), cu_pad.diff().tolist(), strict=True):
        segs += _with_padding(length, slot)
    return _spec(segs, True)


def _add_pair(segs: list, pos: list, qa: int, ql: int, ka: int, kl: int) -> None:
    """Append queries [qa, qa+ql) x keys [ka, ka+kl), skipping the rows in between."""
    if ql == 0 or kl == 0:
        return
    segs += [(qa - pos[0], 0), (0, ka - pos[1]), (ql, kl)]
    pos[0], pos[1] = qa + ql, ka + kl


def ring_step(q_pieces: list[Piece], k_pieces: list[Piece], r: int,
              s: int) -> tuple[StepSpec, StepSpec | None]:
    """Step with the ring block of rank s != r (causal). The block travels as two halves:
    A = the first chunks (chunk s) of its zigzag pieces, B = the second chunks (chunk 2P-1-s),
    each [Z/2] with document j at rows [F_j, F_j + C_j), F_j = local_start / 2. Returns the kernel
    calls against A and against B (None when s < r: chunk 2P-1-s lies after both local chunks).
    Both ranks list the same zigzag documents first, with equal piece lengths."""
    seg_a: list[tuple[int, int]] = []
    seg_b: list[tuple[int, int]] = []
    pos_a, pos_b = [0, 0], [0, 0]
    for qp, kp in zip(q_pieces, k_pieces, strict=False):
        if not qp.zigzag:
            break
        c, f = qp.length // 2, kp.local_start // 2
        real_a, real_b = min(kp.real, c), max(0, kp.real - c)
        if s < r:
            _add_pair(seg_a, pos_a, qp.local_start, qp.real, f, real_a)
        else:
            qa, ql = qp.local_start + c, max(0, qp.real - c)
            _add_pair(seg_a, pos_a, qa, ql, f, real_a)
            _add_pair(seg_b, pos_b, qa, ql, f, real_b)
    return _spec(seg_a, False), (_spec(seg_b, False) if s > r else None)


def chunk_rows(pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [Z/2] local rows of the first chunks (A) and of the second chunks (B) of the zigzag
    pieces, in piece order."""
    first, second = [], []
    for p in pieces:
        if not p.zigzag:
            break
        c = p.length // 2
        first.append(torch.arange(p.local_start, p.local_start + c))
        second.append(torch.arange(p.local_start + c, p.local_start + 2 * c))
    empty = torch.zeros(0, dtype=torch.int64)
    return (torch.cat(first) if first else empty), (torch.cat(second) if second else empty)
