"""Tables and progress lines of bench/long_context.py (markdown, as docs/PERFORMANCE.md quotes
them), from the rows and summary that bench writes to its JSON."""

from __future__ import annotations

GIB = 2**30


def fmt_row(r: dict) -> str:
    if r["over_cap"]:
        return "over cap"
    if "error" in r:
        return "failed"
    return f"{r['peak_bytes'] / GIB:.2f} GiB, {r['tokens_per_s']:.0f} tok/s"


def table(res: dict, sides: list[str], lengths: list[int]) -> str:
    cells = {(r["side"], r["length"]): fmt_row(r) for r in res["rows"]}
    head = "| tokens | " + " | ".join(f"ours {s}" if s != "hf" else "HF Qwen3-MoE" for s in sides) + " |"
    lines = [head, "|---:" + "|---:" * len(sides) + "|"]
    for n in lengths:
        lines.append(f"| {n} | " + " | ".join(cells.get((s, n), "not run") for s in sides) + " |")
    return "\n".join(lines)


def peak_range(m: dict) -> str:
    return f"{m['min_peak_bytes'] / GIB:.2f}-{m['max_peak_bytes'] / GIB:.2f} GiB"


def adamw_bytes(m: dict) -> str:
    return (f"{m['optimizer_bytes'] / 2**20:.0f} MiB "
            f"(replicated: {m['replicated_optimizer_bytes'] / 2**20:.0f} MiB)")


def busiest_ep_rank(m: dict) -> str:
    """Per MoE layer, the largest share of routed rows one EP rank's experts got; with expert
    lending, "-> x" adds the largest share one EP rank ran."""
    shares, ran = m.get("ep_rank_shares"), m.get("ep_rank_run_shares")
    if not shares or len(shares[0]) == 1:
        return ""
    if not ran:
        return " / ".join(f"{max(s):.2f}" for s in shares)
    return " / ".join(f"{max(s):.2f} -> {max(r):.2f}" for s, r in zip(shares, ran, strict=True))


def fmt_multi(m: dict) -> str:
    """The progress line of one 4-rank layout."""
    if "error" in m:
        return f"failed: {m['error']}"
    return f"per-rank peak {peak_range(m)}, AdamW state {adamw_bytes(m)}/rank, step {m['step_s']:.1f} s"


def multi_table(res: dict, layouts: list[str], world: int) -> str:
    n, single = res["multi_length"], res["single_peak_bytes_at_multi_length"]
    lines = [f"{world} gloo ranks, {n} tokens, recompute {res.get('multi_recompute', 'none')}; single rank: "
             + (f"{single / GIB:.2f} GiB" if single else "not measured"),
             "| layout | per-rank peak | largest over single | AdamW state per rank "
             "| busiest EP rank's share of routed rows (-> with lending), by MoE layer |",
             "|---|---:|---:|---:|---|"]
    for k in layouts:
        m = next((m for m in res["multi_rows"] if m["layout"] == k and m["length"] == n), None)
        if m is None or "error" in m:
            lines.append(f"| {k} | {'failed' if m else 'not run'} | | | |")
            continue
        ratio = res["peak_over_single"].get(k)
        lines.append(f"| {k} | {peak_range(m)} | " + (f"{ratio:.3f}x" if ratio else "")
                     + f" | {adamw_bytes(m)} | {busiest_ep_rank(m)} |")
    return "\n".join(lines)
