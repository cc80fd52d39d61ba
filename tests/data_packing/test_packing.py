"""Packing algorithms: property tests (hypothesis) and comparisons with O(n^2) references."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from data_packing.batch import pad_multiple
from data_packing.packing import (
    _FirstSetTree,
    best_fit_decreasing,
    first_fit_decreasing,
    pad_to,
    plan_rows,
)

lengths_st = st.lists(st.integers(1, 300), min_size=0, max_size=60)


def _reference_bfd(sizes, capacity):
    """Textbook BFD: each item, largest first, into the fullest bin that still fits it."""
    free = []
    for s in sorted(sizes, reverse=True):
        fits = [b for b, f in enumerate(free) if f >= s]
        if fits:
            b = min(fits, key=lambda q: free[q])
            free[b] -= s
        else:
            free.append(capacity - s)
    return sorted(capacity - f for f in free)


def _reference_ffd(sizes, capacity):
    """Textbook FFD with item indices, stable on ties (same order as our argsort)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins, free = [], []
    for i in order:
        b = next((q for q, f in enumerate(free) if f >= sizes[i]), None)
        if b is None:
            bins.append([]), free.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        free[b] -= sizes[i]
    return bins


def _check_plan(lengths, plan, seq_len, mult):
    """Rows within seq_len (padded), pieces in order, contiguous, non-empty."""
    padded = pad_to(plan.piece_len, mult)
    for r in range(plan.num_rows):
        lo, hi = plan.row_offsets[r], plan.row_offsets[r + 1]
        assert hi > lo, "empty row"
        assert padded[lo:hi].sum() <= seq_len
    assert (plan.piece_len >= 1).all()
    assert (plan.piece_start + plan.piece_len <= np.asarray(lengths)[plan.piece_doc]).all()


@given(lengths_st, st.integers(1, 400), st.sampled_from([1, 2, 4, 6]),
       st.sampled_from(["bfd", "ffd", "wrapped"]))
def test_split_keeps_every_token_exactly_once_in_order(lengths, seq_len, mult, algorithm):
    seq_len = max(seq_len, mult)
    plan = plan_rows(np.asarray(lengths, dtype=np.int64), seq_len, algorithm, "split", mult)
    _check_plan(lengths, plan, seq_len, mult)
    for d, n in enumerate(lengths):  # pieces of each document tile [0, n) exactly once
        sel = plan.piece_doc == d
        starts, lens = plan.piece_start[sel], plan.piece_len[sel]
        order = np.argsort(starts)
        ends = np.concatenate([[0], (starts + lens)[order]])
        assert (starts[order] == ends[:-1]).all() and ends[-1] == n
    assert plan.counts["tokens_lost"] == 0
    assert plan.counts["docs_split"] == sum(int((plan.piece_doc == d).sum() > 1)
                                            for d in range(len(lengths)))


@given(lengths_st, st.integers(1, 400), st.sampled_from([1, 4]), st.sampled_from(["bfd", "ffd"]))
def test_truncate_and_drop_account_for_every_token(lengths, seq_len, mult, algorithm):
    seq_len = max(seq_len, mult)
    arr = np.asarray(lengths, dtype=np.int64)
    chunk = seq_len // mult * mult
    too_long = pad_to(arr, mult) > seq_len
    for mode in ("truncate", "drop"):
        plan = plan_rows(arr, seq_len, algorithm, mode, mult)
        _check_plan(lengths, plan, seq_len, mult)
        assert (plan.piece_start == 0).all() and len(set(plan.piece_doc.tolist())) == len(plan.piece_doc)
        assert int(plan.piece_len.sum()) + plan.counts["tokens_lost"] == int(arr.sum())
        if mode == "truncate":
            assert plan.counts["docs_truncated"] == int(too_long.sum())
            assert sorted(plan.piece_doc.tolist()) == list(range(len(arr)))
            assert (plan.piece_len == np.where(too_long, chunk, arr)[plan.piece_doc]).all()
        else:
            assert plan.counts["docs_dropped_overflow"] == int(too_long.sum())
            assert sorted(plan.piece_doc.tolist()) == np.flatnonzero(~too_long).tolist()


@given(st.lists(st.integers(1, 64), max_size=80), st.integers(64, 200))
def test_bfd_matches_reference_row_loads(sizes, capacity):
    # Ties between rows with equal free room may be broken differently, but BFD's multiset of
    # row loads does not depend on that choice, so it must match the textbook version exactly.
    bins = best_fit_decreasing(np.asarray(sizes), capacity)
    assert sorted(int(sum(sizes[i] for i in b)) for b in bins) == _reference_bfd(sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))


@given(st.lists(st.integers(1, 64), max_size=80), st.integers(64, 200))
def test_ffd_matches_reference_exactly(sizes, capacity):
    bins = first_fit_decreasing(np.asarray(sizes), capacity)
    assert [sorted(b) for b in bins] == [sorted(b) for b in _reference_ffd(sizes, capacity)]


def test_first_set_tree():
    rng = np.random.default_rng(0)
    tree, members = _FirstSetTree(1000), set()
    for _ in range(3000):
        v = int(rng.integers(0, 1000))
        if rng.random() < 0.5:
            tree.add(v), members.add(v)
        else:
            tree.remove(v), members.discard(v)
        s = int(rng.integers(0, 1000))
        assert tree.first_at_least(s) == min((m for m in members if m >= s), default=-1)


def test_wrapped_fills_rows_in_order():
    plan = plan_rows(np.asarray([5, 7, 3]), 4, "wrapped", "split", 1)
    pieces = list(zip(plan.piece_doc.tolist(), plan.piece_start.tolist(), plan.piece_len.tolist(), strict=True))
    assert pieces == [(0, 0, 4), (0, 4, 1), (1, 0, 3), (1, 3, 4), (2, 0, 3)]
    assert plan.row_offsets.tolist() == [0, 1, 3, 4, 5]
    assert plan.counts["docs_split"] == 2


def test_bfd_is_tight_on_heavy_tail():
    # Lognormal lengths at 8192: BFD should leave only the last rows partly empty.
    lengths = np.maximum(1, np.random.default_rng(1).lognormal(6, 1.5, 5000).astype(np.int64))
    plan = plan_rows(lengths, 8192, "bfd", "split", 1)
    lower_bound = -(-int(lengths.sum()) // 8192)
    assert plan.num_rows <= lower_bound + 1


@pytest.mark.parametrize("kwargs, match", [
    ({"algorithm": "nope"}, "unknown packing algorithm"),
    ({"overflow": "nope"}, "unknown overflow mode"),
    ({"pad_multiple": 16}, "smaller than the CP/TP pad multiple"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_rows(np.asarray([3, 4]), 8, **kwargs)


def test_empty_documents_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        plan_rows(np.asarray([3, 0]), 8)


@pytest.mark.parametrize("cp, tp, multiple", [(1, 1, 1), (1, 4, 4), (2, 1, 4), (2, 2, 4), (3, 4, 12),
                                              (4, 2, 8)])
def test_pad_multiple_is_lcm_of_2cp_and_tp(cp, tp, multiple):
    assert pad_multiple(cp, tp) == multiple
