"""Statistics of a packed output: document accounting, padding, row fill and attention cost.

`summarize` works from the shards' index arrays and counters only (never the tokens), so it is
the same function for a fresh run and for a rerun that skipped finished shards.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from data_packing.documents import DROP_REASONS

COUNTERS = ("docs_in", "docs_packed", "docs_split", "docs_truncated", "docs_dropped_overflow",
            "tokens_in", "tokens_lost") + tuple(f"docs_dropped_{r}" for r in DROP_REASONS)


def summarize(shards, seq_len: int) -> dict:
    """shards: an iterable of {"counters": {...}, "doc_lengths": int [D], "doc_lengths_padded":
    int [D], "row_docs": int [R+1]} -> flat dict of stats (ints and floats, JSON-ready). Shards
    are consumed one at a time; only per-row numbers are kept, so memory follows rows (tokens /
    seq_len), not documents."""
    c, tokens_out, cp_pad, pieces, docs_per_row, sumsq = Counter(), 0, 0, 0, [], []
    for s in shards:
        c.update(s["counters"])
        lens = np.asarray(s["doc_lengths"], np.int64)
        per_row = np.diff(s["row_docs"])
        row_of_piece = np.repeat(np.arange(per_row.size), per_row)
        sumsq.append(np.bincount(row_of_piece, weights=lens.astype(np.float64) ** 2,
                                 minlength=per_row.size))
        docs_per_row.append(per_row)
        tokens_out += int(lens.sum())
        cp_pad += int((np.asarray(s["doc_lengths_padded"], np.int64) - lens).sum())
        pieces += int(lens.size)
    docs_per_row = np.concatenate(docs_per_row) if docs_per_row else np.zeros(0, np.int64)
    sumsq = np.concatenate(sumsq) if sumsq else np.zeros(0)
    rows = int(docs_per_row.size)
    capacity = rows * seq_len
    out = {k: int(c[k]) for k in COUNTERS}
    out["docs_dropped"] = int(sum(c[f"docs_dropped_{r}"] for r in DROP_REASONS)
                              + c["docs_dropped_overflow"])
    out.update(
        tokens_out=tokens_out, rows=rows, pieces=pieces,
        tokens_lost_pct=_pct(c["tokens_lost"], c["tokens_in"]),
        padding_pct=_pct(capacity - tokens_out, capacity),
        cp_padding_tokens=cp_pad,
        docs_split_pct=_pct(c["docs_split"], c["docs_packed"]),
        docs_per_row_mean=round(float(docs_per_row.mean()), 4) if rows else 0.0,
        docs_per_row_max=int(docs_per_row.max()) if rows else 0,
    )
    for q in (50, 90, 99, 100):
        name = "max" if q == 100 else f"p{q}"
        out[f"row_attn_cost_{name}"] = float(np.percentile(sumsq, q)) if rows else 0.0
    check_accounting(out)
    return out


def _pct(part, whole) -> float:
    return round(100.0 * part / whole, 6) if whole else 0.0


def check_accounting(s: dict) -> None:
    """Every input document and token is accounted for; raise if the books do not balance."""
    if s["docs_in"] != s["docs_packed"] + s["docs_dropped"]:
        raise AssertionError(f"document accounting broken: {s['docs_in']} in != "
                             f"{s['docs_packed']} packed + {s['docs_dropped']} dropped")
    if s["tokens_in"] != s["tokens_out"] + s["tokens_lost"]:
        raise AssertionError(f"token accounting broken: {s['tokens_in']} in != "
                             f"{s['tokens_out']} out + {s['tokens_lost']} lost")


def format_stats(stats: dict, timing: dict | None = None) -> str:
    """A two-column table for the terminal."""
    items = list(stats.items()) + list((timing or {}).items())
    width = max(len(k) for k, _ in items)
    lines = []
    for k, v in items:
        if isinstance(v, float):
            val = f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4f}"
        else:
            val = f"{v:,}" if isinstance(v, int) else str(v)
        lines.append(f"  {k:<{width}}  {val:>16}")
    return "\n".join(lines)
