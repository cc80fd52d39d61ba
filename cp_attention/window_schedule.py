"""Kernel calls of a ring step under a sliding window of W keys (schedule.py has the plain ones).

Ring rank r holds chunks r and 2P-1-r of a zigzag document, so the distance in the document
between a local query and a key is not their local distance. Every (query chunk, key chunk) pair
of one document is classified by the document positions of its first rows (chunk k of a zigzag
document with chunk length C starts at kC; a whole document's piece at 0). With lq real queries
from position a and lk real keys from position b, query u sees key w iff 0 <= (a - b) + u - w < W
(the single-device rule: the W latest keys of the document, the query's own included):
- skipped: no distance in [0, W) (no kernel call);
- full: every distance in [0, W): a plain (non-causal) block;
- band: the rest: causal with offset (a - b) - (lk - lq) (see kernels.attn_forward), windowed
  when some distance reaches W.
Pairs go into as few kernel calls as their (kind, window, offset) and row order allow: a call
lists each query row and each key row at most once, in increasing order (schedule._add_pair).

A skipped block is skipped in compute only: its KV half still travels (and, backward, its dK/dV
accumulator, as zeros), so the message schedule of ring.py and RingLayout.traffic stay as they
are. Bytes could be saved too (a half that no rank down the ring needs within W need not travel
on; with W at most one chunk most of the ring is idle), but that needs a window-aware schedule on
both sides of every link and is left alone.
"""

from __future__ import annotations

from dataclasses import replace

from cp_attention.schedule import Piece, StepSpec, _add_pair, _spec

# (doc, first local row, real rows, document position of the first row)
Range = tuple[int, int, int, int]


def local_ranges(pieces: list[Piece], r: int, p: int) -> list[list[Range]]:
    """Per piece of ring rank r: its chunk ranges (zigzag: chunk r, chunk 2P-1-r; whole: one)."""
    out = []
    for pc in pieces:
        if pc.zigzag:
            c = pc.length // 2
            out.append([(pc.doc, pc.local_start, min(pc.real, c), r * c),
                        (pc.doc, pc.local_start + c, max(0, pc.real - c), (2 * p - 1 - r) * c)])
        else:
            out.append([(pc.doc, pc.local_start, pc.real, 0)])
    return out


def half_ranges(pieces: list[Piece], s: int, p: int, half: int) -> list[Range]:
    """Per zigzag piece of ring rank s: its range in half A (half=0, chunk s) or B (chunk 2P-1-s);
    rows [F, F + C) with F = local_start / 2, as ring.py lays the halves out."""
    out = []
    for pc in pieces:
        if not pc.zigzag:
            break
        c = pc.length // 2
        real = min(pc.real, c) if half == 0 else max(0, pc.real - c)
        out.append((pc.doc, pc.local_start // 2, real, (s if half == 0 else 2 * p - 1 - s) * c))
    return out


def classify(lq: int, lk: int, d0: int, window: int) -> tuple | None:
    """(causal, window, offset) of the kernel call a pair needs, or None to skip it (see the
    module docstring; d0 = document position of the first query minus that of the first key)."""
    if lq == 0 or lk == 0:
        return None
    lo, hi = d0 - (lk - 1), d0 + lq - 1  # smallest and largest query-key distance
    if hi < 0 or lo >= window:
        return None
    if lo >= 0 and hi < window:
        return (False, None, 0)
    return (True, window if hi >= window else None, d0 - (lk - lq))


def calls(pairs: list[tuple[Range, Range]], window: int) -> list[StepSpec]:
    """Group the (query range, key range) pairs into kernel calls (see the module docstring)."""
    groups: dict[tuple, list[tuple[list, list]]] = {}
    for (dq, qa, lq, pq), (dk, ka, lk, pk) in pairs:
        if dq != dk:
            raise AssertionError(f"ring window schedule paired documents {dq} and {dk}")
        kind = classify(lq, lk, pq - pk, window)
        if kind is None:
            continue
        slots = groups.setdefault(kind, [])
        slot = next((x for x in slots if qa >= x[1][0] and ka >= x[1][1]), None)
        if slot is None:
            slot = ([], [0, 0])
            slots.append(slot)
        _add_pair(slot[0], slot[1], qa, lq, ka, lk)
    return [replace(_spec(segs, causal), window=w, offset=off)
            for (causal, w, off), slots in groups.items() for segs, _ in slots]


def window_diagonal(pieces: list[Piece], r: int, p: int, window: int) -> list[StepSpec]:
    """Step 0: the local queries against the local keys, chunk by chunk."""
    pairs = [(q, k) for rows in local_ranges(pieces, r, p) for q in rows for k in rows]
    return calls(pairs, window)


def window_ring(q_pieces: list[Piece], k_pieces: list[Piece], r: int, s: int, p: int,
                window: int) -> tuple[list[StepSpec], list[StepSpec]]:
    """Step with the ring block of rank s != r: (calls against half A, calls against half B;
    the latter empty when s < r, where rank r does not receive B)."""
    q_rows = [rows for rows, pc in zip(local_ranges(q_pieces, r, p), q_pieces, strict=True)
              if pc.zigzag]
    out = []
    for half in (0, 1) if s > r else (0,):
        keys = half_ranges(k_pieces, s, p, half)
        out.append(calls([(q, k) for rows, k in zip(q_rows, keys, strict=True) for q in rows],
                         window))
    return out[0], (out[1] if s > r else [])
