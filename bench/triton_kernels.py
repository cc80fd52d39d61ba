"""Triton kernels (longctx_moe/kernels) against their torch path, forward + backward, on a GPU.

    python bench/triton_kernels.py --out bench/results/triton_kernels.json [--quick]

Peer: the torch path of the same op in the same run (execution.kernels=torch). Per op: the median
and spread (min, max) of `--reps` timed forward+backward calls after warm-up, the speed-up
(torch median / Triton median), and the largest difference between the two paths' outputs and
gradients. Sizes are a ~1B MoE at 32K tokens: D=2048, E=64 experts top-8 of hidden F=768
(SwiGLU over the T*K routed rows' [gate | up]), 16 q / 4 k heads of 128 (RoPE), V=151,936
(Qwen's vocabulary) in chunks of 4096 rows, bf16 autocast.

Needs CUDA: under Triton's interpreter (TRITON_INTERPRET=1, CPU) the numbers time numpy, not the
kernels, so there only `--quick` runs, as a check that this program works, and says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_io import write_json  # noqa: E402
from longctx_moe.execution import Target, triton_unavailable  # noqa: E402
from longctx_moe.kernels import triton_ops as ops  # noqa: E402
from longctx_moe.model.config import ModelConfig  # noqa: E402
from longctx_moe.model.layers import RMSNorm, apply_rope, rope_cos_sin  # noqa: E402
from longctx_moe.model.losses import chunked_token_logprobs  # noqa: E402
from longctx_moe.model.moe import Router, _GatherRows, _Permute, permute_layout  # noqa: E402

FULL = dict(t=32768, d=2048, e=64, k=8, f=768, heads=16, kv_heads=4, head_dim=128, v=151936, chunk=4096)
QUICK = dict(t=64, d=64, e=8, k=2, f=48, heads=2, kv_heads=1, head_dim=32, v=600, chunk=16)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _fwd_bwd(run, inputs):
    """run() -> tensors; a fixed-seed weighted sum of them backward: (outputs, input grads)."""
    def call():
        for x in inputs:
            x.grad = None
        outs = run()
        g = torch.Generator(device=outs[0].device).manual_seed(0)
        loss = sum((o.float() * torch.randn(o.shape, device=o.device, generator=g)).sum()
                   for o in outs)
        loss.backward()
        return [o.detach() for o in outs] + [x.grad for x in inputs]
    return call


def _torch_permute(x, idx, w):
    """LocalDispatcher's torch permute + un-permute around identity experts (no padding on GPU)."""
    t, k = idx.shape
    order = torch.argsort(idx.flatten(), stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    x_MD = _GatherRows.apply(x, order // k, inv, k)
    y_TKD = _Permute.apply(x_MD, inv, order).view(t, k, -1)
    return [torch.bmm(w.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)]


def _triton_permute(x, idx, w):
    slot, _, total = permute_layout(idx, int(idx.max()) + 1, pad=False)
    x_PD = ops().permute(x, slot, total)
    return [ops().unpermute(x_PD, slot, w.to(x_PD.dtype))]


def _router_outputs(router, x):
    _, weight_TK, aux = router(x)
    return [weight_TK, aux.scores_TE]


def cases(s: dict, device) -> dict:
    """name -> {kernels: (run, inputs)} at sizes `s`."""
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype).requires_grad_()

    x_bf = rnd(s["t"], s["d"], dtype=bf16)
    idx = torch.stack([torch.randperm(s["e"], device=device, generator=g)[:s["k"]]
                       for _ in range(s["t"])])
    w = torch.rand(s["t"], s["k"], device=device, generator=g).requires_grad_()
    out = {"permute+unpermute": {"torch": (lambda: _torch_permute(x_bf, idx, w), [x_bf, w]),
                                 "triton": (lambda: _triton_permute(x_bf, idx, w), [x_bf, w])}}
    x32 = rnd(s["t"], s["d"])
    routers = {k: Router(ModelConfig(hidden_size=s["d"], num_experts=s["e"], top_k=s["k"],
                                     expert_bias=True), k).to(device) for k in ("torch", "triton")}
    for r in routers.values():
        torch.nn.init.normal_(r.weight, std=0.02, generator=g)
    routers["triton"].load_state_dict(routers["torch"].state_dict())
    out["router top-k"] = {k: (lambda r=r: _router_outputs(r, x32), [x32]) for k, r in routers.items()}
    res = rnd(s["t"], s["d"], dtype=bf16)
    q = rnd(s["t"], s["heads"], s["head_dim"], dtype=bf16)
    norms = {k: RMSNorm(s["d"], 1e-6, k).to(device) for k in ("torch", "triton")}
    out["add + RMSNorm"] = {k: (lambda n=n: list(n(x32, residual=res)), [x32, res])
                            for k, n in norms.items()}
    qk_norms = {k: RMSNorm(s["head_dim"], 1e-6, k).to(device) for k in ("torch", "triton")}
    out["RMSNorm q/k"] = {k: (lambda n=n: [n(q)], [q]) for k, n in qk_norms.items()}
    h, wv = rnd(s["t"], s["d"]), rnd(s["v"], s["d"], scale=0.02)
    labels = torch.randint(0, s["v"], (s["t"],), device=device, generator=g)

    def logprobs(k):
        with torch.autocast(device.type, dtype=bf16):
            return list(chunked_token_logprobs(h, wv, labels, s["chunk"], entropy=True, impl=k))
    out["log-prob + entropy"] = {k: (lambda k=k: logprobs(k), [h, wv]) for k in ("torch", "triton")}
    h_MF2 = rnd(s["t"] * s["k"], 2 * s["f"], dtype=bf16, scale=4.0)
    out["SwiGLU (experts)"] = {"torch": (lambda: [_torch_swiglu(h_MF2)], [h_MF2]),
                               "triton": (lambda: [ops().swiglu(*h_MF2.chunk(2, dim=-1))], [h_MF2])}
    kq = rnd(s["t"], s["kv_heads"], s["head_dim"], dtype=bf16)
    pos = torch.arange(s["t"], device=device) % 4096  # documents of 4096 tokens
    cos, sin = (t.to(bf16) for t in rope_cos_sin(pos, s["head_dim"], 1e6))
    out["RoPE q + k"] = {
        "torch": (lambda: [apply_rope(q, cos, sin), apply_rope(kq, cos, sin)], [q, kq]),
        "triton": (lambda: list(ops().rope(q, kq, cos, sin)), [q, kq])}
    return out


def _torch_swiglu(h_MF2):
    gate, up = h_MF2.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _max_diff(a: list, b: list, relative: bool = False) -> float:
    """Largest |a - b| over the outputs and gradients; relative: each tensor's over its largest
    |b| (a bf16 gradient of magnitude ~2000 differs by 16 in its last bit: 2**-7 relative)."""
    def diff(x, y):
        d = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        return d / max(float(y.double().abs().max()), 1e-30) if relative and x.numel() else d
    return max(diff(x, y) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the interpreter needs them)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interpreting = device.type == "cpu" and triton_unavailable(Target("cpu")) is None
    if device.type == "cpu" and not (interpreting and args.quick):
        sys.exit("error: bench/triton_kernels.py times compiled kernels and needs a CUDA device; "
                 "on CPU only TRITON_INTERPRET=1 with --quick runs (a check of this program)")
    sizes = QUICK if args.quick else FULL
    rows = {}
    print(f"{'op':<20} {'torch ms':>10} {'triton ms':>10} {'speed-up':>9} {'max diff':>9} {'rel diff':>9}")
    for name, paths in cases(sizes, device).items():
        rec = {}
        results = {}
        for kernels, (run, inputs) in paths.items():
            call = _fwd_bwd(run, inputs)
            results[kernels] = call()
            t = _time(call, device, warmup=2, reps=args.reps)
            rec[kernels] = {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
        rec["speedup"] = rec["torch"]["median_s"] / rec["triton"]["median_s"]
        rec["max_abs_diff"] = _max_diff(results["triton"], results["torch"])
        rec["max_rel_diff"] = _max_diff(results["triton"], results["torch"], relative=True)
        rows[name] = rec
        print(f"{name:<20} {rec['torch']['median_s'] * 1e3:>10.3f} "
              f"{rec['triton']['median_s'] * 1e3:>10.3f} {rec['speedup']:>8.2f}x "
              f"{rec['max_abs_diff']:>9.2e} {rec['max_rel_diff']:>9.2e}")
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
            "interpreter": interpreting, "sizes": sizes, "reps": args.reps,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime())}
    write_json(args.out, {"meta": meta, "ops": rows})


if __name__ == "__main__":
    main()
