"""One-shot GPU check: every GPU backend against the CPU float64 reference, then timings.

Run through bench/gpu_check.sh on a lent GPU machine (installs nothing; needs only torch, plus
transformers if the image has it for the HF side). Writes one JSON file.

    python bench/gpu_check.py --out $OUT/gpu_check.json [--device cuda] [--quick]

Checks (each records max errors and pass/fail, never aborts the rest):
  attention.<backend>: fwd out/lse and bwd dq/dk/dv in bf16 vs the float64 reference;
  grouped_gemm: torch._grouped_mm bf16 fwd/bwd vs a float64 per-expert loop;
  model_bf16: one packed batch, loss of the bf16-autocast model on the GPU vs float64 on the CPU.
Timings (medians): attention fwd+bwd per backend on a 32K packed row; one training step of the
bench config (hidden 512, 4 layers, 16 experts top-2) in tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_io import write_json  # noqa: E402
from cp_attention.kernels import BACKENDS, attn_backward, attn_forward, resolve_backend  # noqa: E402
from data_packing.batch import PackedBatch, labels_from_tokens, position_ids_from_cu  # noqa: E402
from longctx_moe.model import ModelConfig, build_model  # noqa: E402


def _doc_lengths(total: int, seed: int) -> list[int]:
    """Lognormal document lengths (heavy tail, like RL rollouts) summing to `total`."""
    g = torch.Generator().manual_seed(seed)
    lens, left = [], total
    while left > 0:
        n = int(torch.empty(1).log_normal_(6.0, 1.2, generator=g).clamp(1, 16384).item())
        n = min(n, left)
        lens.append(n)
        left -= n
    return lens


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    finite = torch.isfinite(b)
    return float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0


def check_attention(device, backend: str) -> dict:
    """bf16 on the GPU vs float64 reference on the CPU. bf16 has an 8-bit mantissa: outputs of a
    softmax-weighted average of O(1) values carry ~1e-2 absolute error; we require < 5e-2."""
    lens = _doc_lengths(4096, seed=1) + [1, 2, 3]
    t, hq, hkv, d = sum(lens), 8, 4, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    cu, mx = _cu(lens, "cpu"), max(lens)
    ref_out, ref_lse = attn_forward(q, k, v, cu, cu, mx, mx, True, backend="reference")
    ref_grads = attn_backward(dout, q, k, v, ref_out, ref_lse, cu, cu, mx, mx, True, backend="reference")
    dev = [x.to(device, torch.bfloat16) for x in (q, k, v, dout)]
    cu_d = cu.to(device)
    out, lse = attn_forward(*dev[:3], cu_d, cu_d, mx, mx, True, backend=backend)
    grads = attn_backward(dev[3], *dev[:3], out, lse, cu_d, cu_d, mx, mx, True, backend=backend)
    errs = {"out": _max_err(out, ref_out), "lse": _max_err(lse, ref_lse)}
    errs.update({n: _max_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True)})
    return {"max_abs_err": errs, "ok": all(e < 5e-2 * 4 if n.startswith("d") else e < 5e-2
                                          for n, e in errs.items())}


def check_grouped_gemm(device) -> dict:
    """bf16 grouped GEMM (K=512 reduction) vs float64 loop: relative error < 2e-2 (bf16 rounding of
    inputs and output, fp32 accumulation)."""
    e, m, d, f = 16, 4096, 512, 512
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, d, generator=g, dtype=torch.float64)
    w = torch.randn(e, d, f, generator=g, dtype=torch.float64) / d**0.5
    counts = torch.multinomial(torch.ones(e), m, replacement=True, generator=g).bincount(minlength=e)
    counts[4] += counts[3]
    counts[3] = 0  # an expert with no tokens
    offs = counts.cumsum(0).to(torch.int32)
    ref = torch.cat([x[s:s + n] @ w[i] for i, (s, n) in enumerate(zip((offs - counts).tolist(), counts.tolist(), strict=True))])
    xb = x.to(device, torch.bfloat16).requires_grad_()
    wb = w.to(device, torch.bfloat16).requires_grad_()
    y = torch._grouped_mm(xb, wb, offs=offs.to(device))
    y.backward(torch.ones_like(y))
    rel = _max_err(y, ref) / float(ref.abs().max())
    return {"rel_err": rel, "ok": rel < 2e-2 and wb.grad is not None and bool(torch.isfinite(wb.grad).all())}


def _batch(lens: list[int], vocab: int, device) -> PackedBatch:
    cu = _cu(lens, "cpu")
    tokens = torch.randint(0, vocab, (sum(lens),), generator=torch.Generator().manual_seed(2))
    return PackedBatch(tokens=tokens, labels=labels_from_tokens(tokens, cu, cu), cu_seqlens=cu,
                       cu_seqlens_padded=cu.clone(), position_ids=position_ids_from_cu(cu, cu, sum(lens)),
                       max_seqlen=max(lens)).to(device)


def check_model_bf16(device) -> dict:
    """Same weights: final hidden states (RMS-normalised, O(1)) of the bf16-autocast model on the
    device vs float64 on the CPU: mean abs error < 2e-2 (bf16 rounding through 2 layers; the max
    is not a fair measure because a near-tie in the router may pick another expert for a few
    tokens), and the losses within 1e-2 relative (a weak check alone: at init it sits near ln(V))."""
    cfg = ModelConfig(vocab_size=1024, hidden_size=256, num_layers=2, num_experts=8, top_k=2)
    torch.manual_seed(0)
    ref_model = build_model(cfg).double()
    gpu_model = build_model(cfg).to(device)
    gpu_model.load_state_dict({k: v.float() for k, v in ref_model.state_dict().items()})
    lens = _doc_lengths(2048, seed=3)
    cpu_batch, dev_batch = _batch(lens, cfg.vocab_size, "cpu"), _batch(lens, cfg.vocab_size, device)
    with torch.no_grad():
        ref, ref_h = ref_model(cpu_batch), ref_model.hidden_states(cpu_batch)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out, h = gpu_model(dev_batch), gpu_model.hidden_states(dev_batch)
    n = cpu_batch.num_target_tokens()
    ref_loss, loss = float(ref.ce_sum) / n, float(out.ce_sum) / n
    h_err = float((h.double().cpu() - ref_h).abs().mean())
    return {"loss_ref_fp64": ref_loss, "loss_bf16": loss, "hidden_mean_err": h_err,
            "hidden_max_err": _max_err(h, ref_h), "ok": abs(loss - ref_loss) / ref_loss < 1e-2 and h_err < 2e-2}


def _median_time(fn, warmup: int, iters: int, device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_attention(device, backend: str, total: int) -> dict:
    lens = _doc_lengths(total, seed=4)
    cu, mx = _cu(lens, device), max(lens)
    q = torch.randn(total, 8, 64, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(total, 4, 64, device=device, dtype=torch.bfloat16) for _ in range(2))

    def step():
        out, lse = attn_forward(q, k, v, cu, cu, mx, mx, True, backend=backend)
        attn_backward(out, q, k, v, out, lse, cu, cu, mx, mx, True, backend=backend)

    sec = _median_time(step, 2, 5, device)
    flops = 4 * 8 * 64 * sum(n * (n + 1) / 2 for n in lens) * 3.5  # fwd (2 matmuls) + bwd (~2.5x)
    return {"tokens": total, "docs": len(lens), "ms": sec * 1e3, "tflops": flops / sec / 1e12}


def time_train_step(device, steps: int) -> dict:
    cfg = ModelConfig(vocab_size=16384, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                      head_dim=64, num_experts=16, top_k=2, expert_hidden_size=512)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch = _batch(_doc_lengths(8 * 2048, seed=5), cfg.vocab_size, device)
    n = batch.num_target_tokens()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(batch)
        (out.ce_sum / n + out.aux_loss + out.z_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sec = _median_time(step, 2, steps, device)
    return {"tokens_per_step": batch.num_tokens, "tokens_per_s": batch.num_tokens / sec}


def _guarded(results: dict, name: str, fn, *args) -> None:
    try:
        results[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc(limit=3)}
    print(f"{name:28s} {json.dumps(results[name])[:160]}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="smaller timings (CPU smoke test)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    res: dict = {"torch": torch.__version__, "device": str(device),
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    for backend in BACKENDS:
        if backend == "reference":
            continue
        try:
            resolve_backend(backend, device)
        except (RuntimeError, ValueError) as exc:
            res[f"attention.{backend}"] = {"ok": None, "skipped": str(exc)}
            continue
        _guarded(res, f"attention.{backend}", check_attention, device, backend)
        total = 8192 if args.quick else 32768
        _guarded(res, f"time.attention.{backend}", time_attention, device, backend, total)
    _guarded(res, "grouped_gemm", check_grouped_gemm, device)
    _guarded(res, "model_bf16", check_model_bf16, device)
    if not args.quick:
        _guarded(res, "time.train_step", time_train_step, device, 5)
    write_json(args.out, res, indent=2)
    failed = [k for k, v in res.items() if isinstance(v, dict) and v.get("ok") is False]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
