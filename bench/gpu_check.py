"""One-shot GPU check: every GPU backend against the CPU float64 reference, then timings.

Run through bench/gpu_check.sh on a lent GPU machine (installs nothing; needs only torch, plus
transformers if the image has it for the HF side). Writes one JSON file, rewritten after every
section, so a run cut short by its timeout keeps the sections it finished.

    python bench/gpu_check.py --out $OUT/gpu_check.json [--device cuda] [--quick]

Checks (each records max errors and pass/fail, never aborts the rest):
  attention.<backend>: fwd out/lse and bwd dq/dk/dv in bf16 vs the float64 reference;
  grouped_gemm: torch._grouped_mm bf16 fwd/bwd vs a float64 per-expert loop;
  model_bf16: one packed batch, loss of the bf16-autocast model on the GPU vs float64 on the CPU;
  check.fp8: execution.fp8=torch's FP8 linear (forward, both gradients) against the float64 product
    of the same quantised operands, on FP8-capable GPUs, per recipe (tensor, delayed; block on
    Hopper).
Timings (medians): attention fwd+bwd per backend on a 32K packed row; one training step of the
bench config (hidden 512, 4 layers, 16 experts top-2) in tokens/s; then, on the ~1B MoE of
MOE_1B (1.08B parameters, 240M active per token):
  time.peak_matmul: TFLOP/s of square matmuls in the trainer's compute dtype (bf16 on cuda,
    8192^3), the MFU denominator, measured in this run;
  time.trainer_step: Trainer.train_step as `longctx-moe train` builds it, one packed row of
    32,768 tokens of heavy-tailed documents: step ms, tokens/s, model TFLOP/s (longctx_moe.model.
    flops: 6 x active matmul parameters per token + causal attention pairs per document), MFU,
    peak GPU memory;
  time.compute_logprobs: rl_hooks' PolicyTrainer.compute_logprobs on ~64K tokens of rollouts of
    128..16K tokens, without and with entropy: tokens/s, forward TFLOP/s and MFU, peak memory.
`--quick` (the CPU smoke run) runs the last three on a tiny model and a few thousand tokens.
A trainer section that fails on cuda with the Triton kernels is rerun with execution.kernels=torch
(`<name>.kernels_torch`), so one broken kernel does not cost the run its MFU.
Reruns inside a lease: `--sections time.trainer_step,...` runs only the sections named (by
prefix), `--set KEY=VALUE` overrides the trainer sections' config (train.compile=true, ...), and
`--profile-dir DIR` writes a torch.profiler table of one more call of each trainer section.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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


def _doc_lengths(total: int, seed: int, lo: int = 1, hi: int = 16384) -> list[int]:
    """Lognormal document lengths in [lo, hi] (heavy tail, like RL rollouts) summing to `total`;
    the last one is raised to `lo` when less is left, so the sum may pass `total` by < lo."""
    g = torch.Generator().manual_seed(seed)
    lens, left = [], total
    while left > 0:
        n = int(torch.empty(1).log_normal_(6.0, 1.2, generator=g).clamp(lo, hi).item())
        n = max(lo, min(n, left))
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


def check_fp8(device) -> dict:
    """execution.fp8=torch's linear on the GPU against the float64 product of the same quantised
    operands (E4M3 x and w, E5M2 output gradient), for each recipe the GPU runs: per-tensor
    scales (torch._scaled_mm); delayed scaling after one step (x and the gradient quantised with
    the scales frozen from a step of 3x their size: not a power of 2, so other values); and where it can, execution.fp8_recipe=block
    (1 x 128 runs, 128 x 128 weight blocks; torch's blockwise-scaled GEMM). Only float32
    accumulation separates each from its reference, so each result is within 1e-4 of its largest
    value (relative)."""
    from longctx_moe.kernels import fp8

    out = {"ok": True}
    for recipe in fp8.RECIPE_CHOICES:
        reason = fp8.unavailable_reason("torch", device, recipe=recipe)
        out[recipe] = _check_fp8_recipe(device, recipe) if reason is None else {"ok": None, "skipped": reason}
        out["ok"] = out["ok"] and out[recipe]["ok"] is not False
    return out


def _check_fp8_recipe(device, recipe: str) -> dict:
    from longctx_moe.kernels import fp8

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(4096, 2048, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(1536, 2048, device=device, generator=g) / 45).requires_grad_()
    dy = torch.randn(4096, 1536, device=device, generator=g).to(torch.bfloat16)
    scaling, frozen = fp8.make_recipe(recipe, 4), {}
    if recipe == "delayed":  # one step of 3x the values fills the history, then its scales hold
        fp8.linear(3 * x.detach(), w, None, torch.bfloat16, scaling).backward(3 * dy)
        w.grad = None
        scaling.advance()
        # the scales that step must leave, from the history's rule (not read back from the recipe)
        frozen = {fmt: torch.finfo(fmt).max / (3 * t.detach().float().abs().amax())
                  for fmt, t in ((fp8.E4M3, x), (fp8.E5M2, dy))}
    y = fp8.linear(x, w, None, torch.bfloat16, scaling)
    y.backward(dy)

    def dq(t, fmt, tile=None, scale=None):  # the recipe's quantise-dequantise (tile None: per tensor)
        if tile is None:
            q, inv = fp8.quantize(t, fmt, scale=scale)
            return q.double() * inv.double()
        return fp8.quantize_tiles(t, fmt, tile).dequantize().double()

    b = fp8.BLOCK  # the tiles of: activations and gradients along K, weights, both along the tokens
    run, wt, tok = ((1, b), (b, b), (b, 1)) if recipe == "block" else (None, None, None)
    wd = dq(w, fp8.E4M3, wt)
    xd, gd = dq(x, fp8.E4M3, run, frozen.get(fp8.E4M3)), dq(dy, fp8.E5M2, run, frozen.get(fp8.E5M2))
    if recipe == "block":  # the weight gradient's operands, quantised along the tokens
        xt, gt = dq(x, fp8.E4M3, tok), dq(dy, fp8.E5M2, tok)
    else:
        xt, gt = xd, gd
    refs = (("y", y, xd @ wd.t()), ("dx", x.grad, gd @ wd), ("dw", w.grad, gt.t() @ xt))
    errs = {name: float((got.detach().double() - ref).abs().max() / ref.abs().max()) for name, got, ref in refs}
    # y and dx are bf16 results: one bf16 rounding (2**-8 relative) on top of the accumulation
    return {"rel_err": errs, "ok": errs["dw"] < 1e-4 and max(errs["y"], errs["dx"]) < 2**-7}


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


def _times(fn, warmup: int, iters: int, device) -> list[float]:
    """Seconds of each of `iters` calls after `warmup` untimed ones; on cuda the queue is drained
    before and after each call, so a time is the GPU work of that call alone."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        times.append(time.perf_counter() - t0)
    return times


def _median_time(fn, warmup: int, iters: int, device) -> float:
    return statistics.median(_times(fn, warmup, iters, device))


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


# ---------------------------------------------------------------- the ~1B MoE through the trainer

# ~1B total parameters (1.08B: 12 layers of 32 experts of hidden 512 hold 84% of them), 240M
# active per token (top-4 experts, GQA 12 query / 4 KV heads of 128, the 32K-vocabulary head).
MOE_1B = dict(vocab_size=32768, hidden_size=1536, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=128,
              num_experts=32, top_k=4, expert_hidden_size=512)
# The CPU smoke run's model: the same code path in seconds on two cores.
MOE_TINY = dict(vocab_size=4096, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                num_experts=8, top_k=2, expert_hidden_size=128)


@dataclasses.dataclass(frozen=True)
class TrainerSizes:
    model: dict
    step_tokens: int  # one packed row per optimizer step; also the log-prob micro-batch budget
    rollout_tokens: int  # the compute_logprobs batch, about
    rollout_lengths: tuple[int, int]  # shortest and longest rollout
    peak_size: int  # the square matmul of the peak probe
    warmup: int
    iters: int


FULL = TrainerSizes(MOE_1B, 32768, 65536, (128, 16384), 8192, warmup=3, iters=5)
QUICK = TrainerSizes(MOE_TINY, 2048, 4096, (16, 1024), 512, warmup=1, iters=2)


def autocast_setting(device) -> str:
    """train.autocast_dtype of the trainer measurements: bf16 on cuda; on CPU `auto`, since a CPU
    without native bf16 emulates it 20-30x slower (the JSON records what it resolved to)."""
    return "bf16" if device.type == "cuda" else "auto"


def measure_peak(device, size: int, warmup: int = 10, iters: int = 20) -> dict:
    """Median TFLOP/s of a size^3 matmul in the trainer's compute dtype: the MFU denominator of
    this machine as it runs now (clocks, power cap), not the datasheet's. The warm-up lets the GPU
    reach its clocks and cuBLAS pick its kernel."""
    from longctx_moe.precision import resolve_compute_dtype

    compute = resolve_compute_dtype(autocast_setting(device), torch.float32, device)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(device, compute.dtype) for _ in range(2))
    times = _times(lambda: a @ b, warmup, iters, device)
    flops = 2 * size**3
    return {"dtype": compute.name, "size": size, "tflops": flops / statistics.median(times) / 1e12,
            "tflops_max": flops / min(times) / 1e12, "compute_dtype": compute.describe()}


def trainer_config(device, sizes: TrainerSizes, kernels: str = "auto"):
    """The Config `longctx-moe train` would load for this model, one row of step_tokens per step."""
    from longctx_moe.config import load_config

    sets = [f"model.{k}={v}" for k, v in sizes.model.items()] + [f"execution.kernels={kernels}"]
    sets += [f"train.device={device.type}", f"train.autocast_dtype={autocast_setting(device)}",
             f"data.micro_batch_tokens={sizes.step_tokens}", f"data.global_batch_tokens={sizes.step_tokens}",
             f"train.steps={sizes.warmup + sizes.iters}", "optim.warmup_steps=0", "optim.lr=1e-4"]
    return load_config(None, sets + EXTRA_SETS)


def build_trainer(cfg, device):
    """Trainer as longctx_moe.train.run builds it (process context, layout, runtime), without the
    corpus: the measurement feeds its own packed row."""
    from longctx_moe.build import build_dims, build_runtime
    from longctx_moe.process import make_context
    from longctx_moe.trainer import Trainer

    ctx = make_context(cfg)
    if device.index is not None and ctx.device != device:  # it takes cuda:LOCAL_RANK, as under torchrun
        raise ValueError(f"the trainer picked {ctx.device}, not --device {device}; set LOCAL_RANK to its index")
    return Trainer(cfg, build_runtime(cfg, build_dims(cfg, ctx), ctx.device), ctx.device)


def model_info(model, cfg, device, dtype) -> dict:
    """Parameter counts and the ops the model runs here (its resolved Ops)."""
    from longctx_moe.model.flops import active_matmul_params

    return {"model": {k: getattr(cfg.model, k) for k in MOE_1B},
            "total_params": sum(p.numel() for p in model.parameters()),
            # what one token multiplies with, lm head included, embedding lookup not: the 6N of MFU
            "active_matmul_params": active_matmul_params(cfg.model),
            "ops": model.ops.as_dict(),
            "compile": cfg.train.compile, "recompute": cfg.train.recompute}  # the defaults of `train`


def _mfu(flops: float, sec: float, peak: dict | None, dtype_name: str) -> dict:
    """Model TFLOP/s and MFU against the peak measured in this run (None, with the reason, when
    the probe failed or measured another dtype than the model computes in)."""
    out = {"model_tflops": flops / sec / 1e12, "mfu": None}
    if not peak or "tflops" not in peak:
        out["mfu_skipped"] = "no peak: time.peak_matmul failed"
    elif peak["dtype"] != dtype_name:
        out["mfu_skipped"] = f"peak measured in {peak['dtype']}, the model computes in {dtype_name}"
    else:
        out["mfu"] = out["model_tflops"] / peak["tflops"]
    return out


EXTRA_SETS: list[str] = []  # --set: overrides of the trainer sections' config (train.compile=true, ...)
PROFILE_DIR: Path | None = None  # --profile-dir: a torch.profiler table of one timed call per section


def _profile(name: str, fn, device) -> None:
    """One more call of `fn` under torch.profiler; its ops by device time (self) to PROFILE_DIR/name.txt."""
    if PROFILE_DIR is None:
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    (PROFILE_DIR / f"{name}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=45,
                                                                       max_name_column_width=70))


def _gpu_memory(device) -> dict:
    if device.type != "cuda":
        return {"peak_gpu_memory_gib": None, "peak_gpu_memory_skipped": f"device is {device.type}: no GPU memory"}
    return {"peak_gpu_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def time_trainer_step(device, sizes: TrainerSizes, peak: dict | None, kernels: str = "auto") -> dict:
    """Trainer.train_step on one packed row of heavy-tailed documents: medians after warm-up.
    The headline figures come first: the log line shows the first 160 characters."""
    cfg = trainer_config(device, sizes, kernels)
    trainer = build_trainer(cfg, device)
    info = model_info(trainer.model, cfg, device, trainer.compute.dtype)
    print(f"trainer_step model: {info['total_params'] / 1e9:.3f}B parameters, "
          f"{info['active_matmul_params'] / 1e6:.0f}M active per token", flush=True)
    lens = _doc_lengths(sizes.step_tokens, seed=6)
    batch = _batch(lens, cfg.model.vocab_size, "cpu")  # on the host, as the loader gives it
    results = []
    times = _times(lambda: results.append(trainer.train_step([batch])), sizes.warmup, sizes.iters, device)
    last, sec = results[-1], statistics.median(times)
    _profile("profile_trainer_step", lambda: trainer.train_step([batch]), device)
    return {"step_ms": sec * 1e3, "tokens_per_s": sum(lens) / sec,
            **_mfu(last.flops, sec, peak, trainer.compute.name), **_gpu_memory(device),
            "model_tflop_per_step": last.flops / 1e12, "step_ms_all": [t * 1e3 for t in times],
            "tokens": sum(lens), "docs": len(lens), "longest_doc": max(lens),
            "warmup_steps": sizes.warmup, "timed_steps": sizes.iters, "loss": last.loss,
            "skipped_steps": sum(r.skipped for r in results), "compute_dtype": trainer.compute.describe(),
            **info}


def rollout_batch(sizes: TrainerSizes, vocab: int, seed: int = 7):
    """A RolloutBatch of random ids: ragged rollouts (lognormal lengths in rollout_lengths) of
    about rollout_tokens, an eighth of each the prompt."""
    from rl_hooks.batch import RolloutBatch

    lens = _doc_lengths(sizes.rollout_tokens, seed, *sizes.rollout_lengths)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    return RolloutBatch.from_sequences([s[:max(1, len(s) // 8)] for s in seqs],
                                       [s[max(1, len(s) // 8):] for s in seqs])


def time_compute_logprobs(device, sizes: TrainerSizes, peak: dict | None, kernels: str = "auto") -> dict:
    """PolicyTrainer.compute_logprobs (the old-log-prob pass of an RL step) on ragged rollouts,
    micro-batches of step_tokens, PolicyTrainer's defaults otherwise (batch-invariant attention:
    one kernel call per sequence); without and with the entropy. Headline figures first."""
    from longctx_moe.metrics import reset_peak_memory
    from longctx_moe.model.flops import model_flops
    from rl_hooks.api import PolicyTrainer

    cfg = trainer_config(device, sizes, kernels)
    policy = PolicyTrainer(cfg, micro_batch_tokens=sizes.step_tokens)
    compute = policy.trainer.compute
    batch = rollout_batch(sizes, cfg.model.vocab_size)
    lens, t = batch.seq_lengths(), batch.num_tokens
    fwd_flops = model_flops(cfg.model, lens) / 3  # the forward is a third of training's 6N + pairs
    reset_peak_memory(device)
    out = {}
    for suffix, entropy in (("", False), ("_entropy", True)):
        sec = statistics.median(_times(lambda e=entropy: policy.compute_logprobs(batch, return_entropy=e),
                                       sizes.warmup, sizes.iters, device))
        mfu = _mfu(fwd_flops, sec, peak, compute.name)
        out.update({f"tokens_per_s{suffix}": t / sec, f"call_ms{suffix}": sec * 1e3,
                    f"model_tflops_fwd{suffix}": mfu["model_tflops"], f"mfu_fwd{suffix}": mfu["mfu"]})
        if "mfu_skipped" in mfu:
            out["mfu_skipped"] = mfu["mfu_skipped"]
    _profile("profile_compute_logprobs", lambda: policy.compute_logprobs(batch), device)
    return {**out, **_gpu_memory(device), "tokens": t, "seqs": len(lens), "shortest": min(lens),
            "longest": max(lens), "micro_batch_tokens": policy.budget, "batch_invariant": policy.batch_invariant,
            "warmup_calls": sizes.warmup, "timed_calls": sizes.iters, "compute_dtype": compute.describe(),
            **model_info(policy.runtime.model, cfg, device, compute.dtype)}


def _guarded(results: dict, name: str, fn, *args) -> None:
    try:
        results[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc(limit=3)}
    print(f"{name:28s} {json.dumps(results[name])[:160]}", flush=True)


# Every section a run can hold, in run order (attention ones per GPU backend).
SECTIONS = tuple(f"{kind}.{b}" for b in BACKENDS if b != "reference" for kind in ("attention", "time.attention")) + (
    "grouped_gemm", "model_bf16", "check.fp8", "time.train_step", "time.peak_matmul", "time.trainer_step",
    "time.trainer_step.kernels_torch", "time.compute_logprobs", "time.compute_logprobs.kernels_torch")


def device_parser(description: str, quick_help: str) -> argparse.ArgumentParser:
    """The options of every program gpu_check.sh runs on the device: --out, --device, --quick."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    return ap


def device_of(ap: argparse.ArgumentParser, args) -> torch.device:
    """--device, refused in one line where this torch sees no CUDA device."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    return device


def main(argv=None) -> int:
    ap = device_parser(__doc__.splitlines()[0], "smaller timings and a tiny model (CPU smoke test)")
    ap.add_argument("--sections", help="comma-separated names: run only the sections whose name starts "
                                       "with one of them (time.peak_matmul runs with the trainer's)")
    ap.add_argument("--profile-dir", type=Path, help="write a torch.profiler table of one trainer step "
                                                     "and one compute_logprobs call there")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override of the trainer sections, repeatable (as `longctx-moe train --set`)")
    args = ap.parse_args(argv)
    global PROFILE_DIR
    PROFILE_DIR = args.profile_dir
    EXTRA_SETS.extend(args.overrides)
    wanted = args.sections.split(",") if args.sections else None
    unknown = [w for w in wanted or () if not any(name.startswith(w) for name in SECTIONS)]
    if unknown:  # a typo would otherwise run nothing and report "all checks passed"
        ap.error(f"--sections {unknown[0]!r} names no section; choose from {', '.join(SECTIONS)}")
    device = device_of(ap, args)
    res: dict = {"torch": torch.__version__, "device": str(device), "quick": args.quick, "sets": EXTRA_SETS,
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}

    def chosen(name: str) -> bool:
        needed = name == "time.peak_matmul" and any(w.startswith("time.") for w in wanted or ())
        return wanted is None or needed or any(name.startswith(w) for w in wanted)

    def run(name: str, fn, *fn_args) -> None:
        if not chosen(name):
            return
        _guarded(res, name, fn, *fn_args)
        write_json(args.out, res, indent=2)  # a timeout later keeps what is done
        gc.collect()  # a model held in reference cycles would count in the next section's peak memory

    for backend in BACKENDS:
        if backend == "reference":
            continue
        try:
            resolve_backend(backend, device)
        except (RuntimeError, ValueError) as exc:
            if chosen(f"attention.{backend}"):
                res[f"attention.{backend}"] = {"ok": None, "skipped": str(exc)}
            continue
        run(f"attention.{backend}", check_attention, device, backend)
        total = 8192 if args.quick else 32768
        run(f"time.attention.{backend}", time_attention, device, backend, total)
    run("grouped_gemm", check_grouped_gemm, device)
    run("model_bf16", check_model_bf16, device)
    from longctx_moe.kernels import fp8

    fp8_reason = fp8.unavailable_reason("torch", device)
    if fp8_reason is None:
        run("check.fp8", check_fp8, device)
    elif chosen("check.fp8"):
        res["check.fp8"] = {"ok": None, "skipped": fp8_reason}
    if not args.quick:
        run("time.train_step", time_train_step, device, 5)
    elif chosen("time.train_step"):
        res["time.train_step"] = {"ok": None, "skipped": "--quick: time.trainer_step covers the path"}
    sizes = QUICK if args.quick else FULL
    run("time.peak_matmul", measure_peak, device, sizes.peak_size)
    peak = res.get("time.peak_matmul")
    for name, fn in (("time.trainer_step", time_trainer_step), ("time.compute_logprobs", time_compute_logprobs)):
        run(name, fn, device, sizes, peak)
        if res.get(name, {}).get("ok") is False and device.type == "cuda":
            # a first GPU run must not lose the MFU to one kernel: the torch path measures it,
            # and the failure above stays recorded
            run(f"{name}.kernels_torch", fn, device, sizes, peak, "torch")
    write_json(args.out, res, indent=2)  # skipped sections too
    failed = [k for k, v in res.items() if isinstance(v, dict) and v.get("ok") is False]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
