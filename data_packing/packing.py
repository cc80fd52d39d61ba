"""Packing algorithms: place documents (token counts) into rows of at most `seq_len` tokens.

Every algorithm works on integer sizes only and returns a `PackPlan`: the pieces of documents
(document index, first token, real length) in row order, plus row boundaries. Tokens are never
touched here, so the algorithms are cheap to property-test.

- `bfd`: best-fit decreasing. Items go, largest first, into the row with the least free room that
  still fits them. O(n log S): a segment tree over free-capacity values (S = seq_len) finds the
  tightest row, and equal-sized items are placed in bulk (a row that just took an item of size s
  stays the tightest fit for the next item of size s while it still has room for it).
- `ffd`: first-fit decreasing, O(n log n) with a max segment tree over rows.
- `wrapped`: concatenate in input order and cut rows at `seq_len` (documents straddling a cut are
  split into pieces; nothing is padded except the CP/TP multiple).

Each document piece occupies `pad_to(len, pad_multiple)` physical tokens of its row (CP/TP
padding); rows are filled up to `seq_len` physical tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data_packing.batch import pad_to

ALGORITHMS = ("bfd", "ffd", "wrapped")
OVERFLOW_MODES = ("split", "truncate", "drop")


@dataclass
class PackPlan:
    """Pieces in row order. P pieces, R rows.

    piece_doc int64 [P]: input document index; piece_start int64 [P]: first token inside the
    document; piece_len int64 [P]: real tokens; row_offsets int64 [R+1]: pieces of row r are
    [row_offsets[r], row_offsets[r+1]).
    """

    piece_doc: np.ndarray
    piece_start: np.ndarray
    piece_len: np.ndarray
    row_offsets: np.ndarray
    counts: dict = field(default_factory=dict)  # docs_split, docs_truncated, docs_dropped_overflow, tokens_lost

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1


class _FirstSetTree:
    """Set of integers in [0, n): add, remove, and smallest member >= s, all O(log n)."""

    def __init__(self, n: int):
        self.size = 1 << max(1, (n - 1).bit_length())
        self.count = [0] * (2 * self.size)

    def add(self, v: int) -> None:
        i = v + self.size
        if self.count[i]:
            return
        while i:
            self.count[i] += 1
            i >>= 1

    def remove(self, v: int) -> None:
        i = v + self.size
        if not self.count[i]:
            return
        while i:
            self.count[i] -= 1
            i >>= 1

    def first_at_least(self, s: int) -> int:
        """Smallest member >= s, or -1."""
        c, i = self.count, s + self.size
        if c[i]:
            return s
        while i > 1:  # climb until a right sibling holds something
            if not i & 1 and c[i + 1]:
                i += 1
                break
            i >>= 1
        else:
            return -1
        while i < self.size:  # descend to the leftmost member
            i = 2 * i if c[2 * i] else 2 * i + 1
        return i - self.size


class _MaxTree:
    """Fixed array of n values: point update and leftmost index with value >= s, O(log n)."""

    def __init__(self, n: int, init: int):
        self.size = 1 << max(1, (n - 1).bit_length())
        self.t = [init] * (2 * self.size)

    def set(self, i: int, v: int) -> None:
        t, i = self.t, i + self.size
        t[i] = v
        i >>= 1
        while i:
            t[i] = max(t[2 * i], t[2 * i + 1])
            i >>= 1

    def leftmost_at_least(self, s: int) -> int:
        t = self.t
        if t[1] < s:
            return -1
        i = 1
        while i < self.size:
            i = 2 * i if t[2 * i] >= s else 2 * i + 1
        return i - self.size


def _runs(sizes: np.ndarray):
    """Items largest first: (order int64 [n], and per run of equal sizes: size, first, end)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    ordered = sizes[order]
    first = np.flatnonzero(np.diff(ordered, prepend=-1) != 0)
    end = np.append(first[1:], len(ordered)) if len(first) else first
    return order, zip(ordered[first].tolist(), first.tolist(), end.tolist(), strict=True)


def _to_item_bins(order: np.ndarray, bin_sorted: np.ndarray) -> np.ndarray:
    bin_of = np.empty_like(bin_sorted)
    bin_of[order] = bin_sorted
    return bin_of


def bfd_bin_of(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """BFD: int64 [n], the bin of each item (bins numbered in the order they are opened).
    sizes: int [n], each in [1, capacity]. Per-item state lives in numpy arrays, so planning a
    shard costs a few dozen bytes per document."""
    order, runs = _runs(sizes)
    bin_sorted = np.empty(len(order), np.int64)
    tree = _FirstSetTree(capacity + 1)
    by_free: dict[int, list[int]] = {}  # free capacity -> bins with exactly that much room
    n_bins = 0
    for s, i, j in runs:
        while i < j:  # place the run of equal items, several at a time per bin
            free = tree.first_at_least(s)
            if free < 0:
                b, free, n_bins = n_bins, capacity, n_bins + 1
            else:
                stack = by_free[free]
                b = stack.pop()
                if not stack:
                    tree.remove(free)
            k = min(j - i, free // s)
            bin_sorted[i:i + k] = b
            i += k
            free -= k * s
            if free > 0:
                by_free.setdefault(free, []).append(b)
                tree.add(free)
    return _to_item_bins(order, bin_sorted)


def ffd_bin_of(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """FFD: the bin of each item. Unopened bins sit in the tree with full capacity, so the
    leftmost bin with room is either an open one or the next fresh one."""
    order, runs = _runs(sizes)
    n = len(order)
    bin_sorted = np.empty(n, np.int64)
    tree = _MaxTree(max(n, 1), capacity)
    for s, i, j in runs:
        while i < j:
            b = tree.leftmost_at_least(s)
            free = tree.t[b + tree.size]
            k = min(j - i, free // s)
            bin_sorted[i:i + k] = b
            i += k
            tree.set(b, free - k * s)
    return _to_item_bins(order, bin_sorted)


def _bin_lists(bin_of: np.ndarray) -> list[list[int]]:
    n_bins = int(bin_of.max()) + 1 if len(bin_of) else 0
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i, b in enumerate(bin_of.tolist()):
        bins[b].append(i)
    return bins


def best_fit_decreasing(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, ascending) from BFD. sizes: int [n], each in [1, capacity]."""
    return _bin_lists(bfd_bin_of(sizes, capacity))


def first_fit_decreasing(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, ascending) from FFD."""
    return _bin_lists(ffd_bin_of(sizes, capacity))


def _apply_overflow(lengths: np.ndarray, seq_len: int, pad_multiple: int, overflow: str):
    """Pieces before packing: (doc, start, len) arrays and counts. Documents whose padded length
    exceeds seq_len are split into chunks of the largest multiple of pad_multiple <= seq_len,
    truncated to one such chunk, or dropped."""
    chunk = (seq_len // pad_multiple) * pad_multiple
    n_pieces = np.where(pad_to(lengths, pad_multiple) > seq_len, -(-lengths // chunk), 1)
    long_docs = n_pieces > 1
    counts = {"docs_split": 0, "docs_truncated": 0, "docs_dropped_overflow": 0, "tokens_lost": 0}
    if overflow == "split":
        counts["docs_split"] = int(long_docs.sum())
        doc = np.repeat(np.arange(len(lengths)), n_pieces)
        first = np.cumsum(n_pieces) - n_pieces
        k = np.arange(len(doc)) - np.repeat(first, n_pieces)  # piece number inside its document
        start = k * chunk
        return doc, start, np.minimum(chunk, lengths[doc] - start), counts
    keep = np.ones(len(lengths), dtype=bool)
    if overflow == "truncate":
        counts["docs_truncated"] = int(long_docs.sum())
        counts["tokens_lost"] = int((lengths[long_docs] - chunk).sum())
        new_len = np.where(long_docs, chunk, lengths)
    else:  # drop
        counts["docs_dropped_overflow"] = int(long_docs.sum())
        counts["tokens_lost"] = int(lengths[long_docs].sum())
        keep, new_len = ~long_docs, lengths
    doc = np.flatnonzero(keep)
    return doc, np.zeros(len(doc), dtype=np.int64), new_len[keep], counts


def _wrap(lengths: np.ndarray, seq_len: int, pad_multiple: int):
    """Fill rows in input order, cutting documents at row ends (cuts on pad_multiple)."""
    doc, start, plen, row_ends = [], [], [], []
    used, split = 0, 0
    for d, n in enumerate(lengths.tolist()):
        s, pieces = 0, 0
        while s < n:
            room = ((seq_len - used) // pad_multiple) * pad_multiple
            if room == 0:
                row_ends.append(len(doc))
                used = 0
                continue
            take = min(n - s, room)
            doc.append(d), start.append(s), plen.append(take)
            used += pad_to(take, pad_multiple)
            s += take
            pieces += 1
        split += pieces > 1
    if used:
        row_ends.append(len(doc))
    arrays = [np.asarray(a, dtype=np.int64) for a in (doc, start, plen)]
    return arrays, np.asarray([0] + row_ends, dtype=np.int64), split


def plan_rows(lengths: np.ndarray, seq_len: int, algorithm: str = "bfd", overflow: str = "split",
              pad_multiple: int = 1) -> PackPlan:
    """Pack documents of `lengths` (int [N], each >= 1) into rows of seq_len physical tokens.

    Pieces inside a row are ordered by (document, start) so rows read in corpus order.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; use one of {ALGORITHMS}")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"unknown overflow mode {overflow!r}; use one of {OVERFLOW_MODES}")
    if seq_len < pad_multiple:
        raise ValueError(f"seq_len={seq_len} is smaller than the CP/TP pad multiple {pad_multiple}; "
                         "raise --seq-len or lower --cp-size/--tp-size")
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.min() < 1:
        raise ValueError("plan_rows: every document needs at least one token (drop empty ones first)")
    if algorithm == "wrapped":
        mode = "truncate" if overflow == "split" else overflow  # split happens by wrapping
        doc, start, plen, counts = _apply_overflow(lengths, seq_len, pad_multiple, mode)
        if overflow == "split":
            doc, start, plen = np.arange(len(lengths)), np.zeros(len(lengths), np.int64), lengths
            counts = dict(counts, docs_truncated=0, tokens_lost=0)
        (wdoc, wstart, wlen), row_offsets, split = _wrap(plen, seq_len, pad_multiple)
        counts["docs_split"] = split
        return PackPlan(doc[wdoc], start[wdoc] + wstart, wlen, row_offsets, counts)
    doc, start, plen, counts = _apply_overflow(lengths, seq_len, pad_multiple, overflow)
    packer = bfd_bin_of if algorithm == "bfd" else ffd_bin_of
    bin_of = packer(pad_to(plen, pad_multiple), seq_len)
    # rows in the order they were opened; inside a row, piece indices ascending, which is
    # (document, start) order
    flat = np.argsort(bin_of, kind="stable")
    row_offsets = np.zeros(int(bin_of.max()) + 2 if len(bin_of) else 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of), out=row_offsets[1:])
    return PackPlan(doc[flat], start[flat], plen[flat], row_offsets, counts)
