"""Benchmark: varlen attention (torch_cpu backend) vs torch SDPA with a dense block-diagonal mask.

One packed 2048-token row of ~6 documents of realistic lengths, 8 query / 4 KV heads of 64, in the
dtype a run here computes in (`--dtype auto`: bf16 where the CPU has native bf16, else float32),
causal. Both sides run forward and forward+backward on the same tensors in the same process;
the table reports medians and the ratio SDPA / ours (> 1 means ours is faster). Where the brgemm
backward runs (cp_attention.kernels.amx_backward: AMX or AVX512-BF16), ours is also timed with
aten's backward, and the backward alone (one retained graph) is timed with each, giving the ratio
aten / brgemm backward; where the brgemm forward runs (cp_attention.kernels.brgemm_forward), ours
is also timed with aten's forward, and the ratio aten / brgemm forward is reported.

    python bench/attention_kernels.py [--reps 20] [--lengths 700,500,...] [--threads N]
                                      [--forward-only | --backward-only] [--out FILE]

--backward-only times only the two backwards (long documents: SDPA's dense backward is slow).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# bench/cp_attention.py is named like the package: keep bench/ off the import path, the repo root on.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_io import DTYPE_CHOICES, compute_dtype, write_json  # noqa: E402
from cp_attention import native  # noqa: E402
from cp_attention.kernels import amx_backward, brgemm_forward, varlen_attention  # noqa: E402
from cp_attention.kernels.reference import doc_mask_TS  # noqa: E402

# Lengths drawn once from a log-normal fit of web/code documents packed into a 2048-token row.
DEFAULT_LENGTHS = [731, 402, 356, 281, 176, 102]


def _interleaved_medians(fns: dict, reps: int, warmup: int = 2) -> dict:
    """Median wall ms of each callable; the callables alternate within every repetition so
    that both sides see the same machine load (this CPU is shared)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _inputs(lengths, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(t, hkv, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(t, hkv, d, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(t, hq, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, dout, cu


def _ours(q, k, v, dout, cu, max_len, backward, amx=True, brgemm_fwd=True):
    with (contextlib.nullcontext() if amx else amx_backward.disabled(),
          contextlib.nullcontext() if brgemm_fwd else brgemm_forward.disabled()):
        out, _ = varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True)
        if backward:
            out.backward(dout)


def _sdpa(q, k, v, dout, mask_TT, backward):
    # [1, H, T, D] views of the same THD tensors; GQA by repeating kv heads (enable_gqa is not
    # in every supported torch release).
    g = q.shape[1] // k.shape[1]
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k.repeat_interleave(g, 1),
                                                          v.repeat_interleave(g, 1)))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask_TT)
    if backward:
        out.backward(dout.transpose(0, 1).unsqueeze(0))


def _backward_alone(q, k, v, dout, cu, max_len, reps) -> dict:
    """Median ms of the backward alone on one retained graph, the brgemm kernel's against
    aten's, interleaved."""
    out, _ = varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=True)
    brgemm = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def aten():
        with amx_backward.disabled():
            brgemm()

    t = _interleaved_medians({"brgemm": brgemm, "aten": aten}, reps)
    return {"brgemm_bwd_ms": t["brgemm"], "aten_bwd_ms": t["aten"],
            "ratio_aten_bwd_over_brgemm_bwd": t["aten"] / t["brgemm"]}


def run(lengths, reps, hq=8, hkv=4, d=64, dtype=torch.bfloat16, forward_only=False,
        backward_only=False):
    q, k, v, dout, cu = _inputs(lengths, hq, hkv, d, dtype)
    res = {}
    if not forward_only and amx_backward.available():
        res |= _backward_alone(q, k, v, dout, cu, max(lengths), reps)
    if not backward_only:
        res |= _compare(q, k, v, dout, cu, lengths, reps, forward_only)
    res["amx_backward"] = amx_backward.available()  # the brgemm backward (AMX or AVX512-BF16)
    res["brgemm_forward"] = brgemm_forward.available()
    res.update(lengths=lengths, tokens=sum(lengths), heads_q=hq, heads_kv=hkv, head_dim=d,
               dtype=str(dtype), reps=reps, threads=torch.get_num_threads(),
               torch=torch.__version__)
    return res


def _compare(q, k, v, dout, cu, lengths, reps, forward_only) -> dict:
    """Ours against SDPA, forward and forward+backward, with each of our kernels swapped out."""
    mask_TT = doc_mask_TS(cu, cu, q.shape[0], k.shape[0], causal=True)
    ours = lambda b: _ours(q, k, v, dout, cu, max(lengths), b)
    sdpa = lambda b: _sdpa(q, k, v, dout, mask_TT, b)
    fns = {"ours": lambda: ours(False), "sdpa": lambda: sdpa(False)}
    if brgemm_forward.available():  # ours with aten's forward instead of the brgemm kernel
        fns["ours_aten_fwd"] = lambda: _ours(q, k, v, dout, cu, max(lengths), False, brgemm_fwd=False)
    with torch.no_grad():
        res = {f"{n}_fwd_ms": t for n, t in _interleaved_medians(fns, reps).items()}
    res["ratio_fwd"] = res["sdpa_fwd_ms"] / res["ours_fwd_ms"]
    if "ours_aten_fwd_fwd_ms" in res:
        res["ratio_aten_fwd_over_brgemm_fwd"] = res["ours_aten_fwd_fwd_ms"] / res["ours_fwd_ms"]
    if not forward_only:
        fns = {"ours": lambda: ours(True), "sdpa": lambda: sdpa(True)}
        if amx_backward.available():  # ours with aten's backward instead of the brgemm kernel
            fns["ours_aten_bwd"] = lambda: _ours(q, k, v, dout, cu, max(lengths), True, amx=False)
        res |= {f"{n}_fwd_bwd_ms": t for n, t in _interleaved_medians(fns, reps).items()}
        res["ratio_fwd_bwd"] = res["sdpa_fwd_bwd_ms"] / res["ours_fwd_bwd_ms"]
    return res


def _table(r) -> str:
    lines = [f"{r['tokens']} tokens, docs {r['lengths']}, {r['dtype']}, Hq={r['heads_q']} "
             f"Hkv={r['heads_kv']} D={r['head_dim']}, median of {r['reps']}, "
             f"{r['threads']} threads"]
    if "ours_fwd_ms" in r:
        lines += _compare_table(r)
    if "brgemm_bwd_ms" in r:
        lines += [f"{'backward alone, ms':<26}{'brgemm':>10}{'aten':>12}",
                  f"{'':<26}{r['brgemm_bwd_ms']:>10.2f}{r['aten_bwd_ms']:>12.2f}",
                  f"{'ratio aten bwd / brgemm':<26}{r['ratio_aten_bwd_over_brgemm_bwd']:>9.2f}x"]
    return "\n".join(lines)


def _compare_table(r) -> list:
    nan = float("nan")
    rows = [("torch_cpu varlen (ours)", r["ours_fwd_ms"], r.get("ours_fwd_bwd_ms", nan)),
            ("SDPA + block-diag mask", r["sdpa_fwd_ms"], r.get("sdpa_fwd_bwd_ms", nan))]
    if "ours_aten_bwd_fwd_bwd_ms" in r:
        rows.insert(1, ("ours, aten's backward", r["ours_fwd_ms"], r["ours_aten_bwd_fwd_bwd_ms"]))
    if "ours_aten_fwd_fwd_ms" in r:
        rows.insert(1, ("ours, aten's forward", r["ours_aten_fwd_fwd_ms"], nan))
    lines = [f"{'implementation':<26}{'fwd ms':>10}{'fwd+bwd ms':>12}",
             *(f"{n:<26}{a:>10.2f}{b:>12.2f}" for n, a, b in rows),
             f"{'ratio SDPA / ours':<26}{r['ratio_fwd']:>9.2f}x{r.get('ratio_fwd_bwd', nan):>11.2f}x"]
    if "ratio_aten_fwd_over_brgemm_fwd" in r:
        lines.append(f"{'ratio aten fwd / brgemm':<26}{r['ratio_aten_fwd_over_brgemm_fwd']:>9.2f}x")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--lengths", type=str, default=",".join(map(str, DEFAULT_LENGTHS)))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--forward-only", action="store_true",
                      help="time forwards only (long documents: SDPA's dense backward is slow)")
    mode.add_argument("--backward-only", action="store_true",
                      help="time our backward alone, brgemm kernel vs aten's (where it runs)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="auto: bf16 where the CPU has native bf16 (AVX512-BF16 / AMX), else float32")
    p.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.backward_only and not amx_backward.available():
        p.error("--backward-only compares the brgemm backward with aten's, which cannot run here: "
                f"{native.unavailable_reason('attention_bwd')}")
    res = run([int(x) for x in a.lengths.split(",")], a.reps, dtype=compute_dtype(a.dtype).dtype,
              forward_only=a.forward_only, backward_only=a.backward_only)
    print(_table(res))
    write_json(a.out, res, indent=2)


if __name__ == "__main__":
    main()
