"""Offload on a GPU: what rl_hooks/offload.py and optim.offload=cpu do with real device memory,
pinned host memory and asynchronous copies, which the CPU tests cannot show.

A PolicyTrainer of the ~1B bench MoE's shapes (bench/gpu_check.py MOE_1B) cut to 2 of its 12
layers (0.27B parameters: ~4 GB of fp32 weights, gradients and AdamW state, so that allocations
outside the trainer stay far below 2% of it, and the six trainers the section builds stay quick) runs
GRPO-shaped updates (kind pg, advantage 1 on every response token: its loss is the responses'
mean negative log-prob, which moves at every step and never sits near 0) on 4,096 tokens.

round_trip.<param dtype> (train.param_dtype fp32 and bf16; bf16 autocast on cuda):
  after an update and a backward whose gradients wait for their step,
  torch.cuda.memory_allocated before offload(), after it and after onload();
  `offload_residual_frac_gpu`: after / before (acceptance: <= 0.02, the worst of both dtypes),
  and the same net of what the process held before the trainer was built (cuBLAS's workspaces
  made beforehand: they are the process's, not the trainer's);
  every host buffer pinned (the copies are asynchronous only from pinned memory);
  every byte of the trainer's storages back as it was, and the optimizer step after the round
  trip bitwise the step without it (`offload_bitwise`). The step without it runs on a second
  trainer built alike whose storages are given the first one's bytes before its step: a GPU's
  forward and backward are not bitwise reproducible run to run (the MoE combine's index_add_
  accumulates with atomics in a varying order), so the two trainers start the step from the same
  bytes, and the update is then a deterministic function of them.
optim_offload: optim.offload=cpu against the device optimizer, STEPS updates each, float32
  weights and compute (OPTIM_SETS). `optim_offload_max_rel_loss_diff` over the steps, against OPTIM_TOL;
  HostAdamW's masters and gradient buffers pinned (the host ends of its copies; AdamW's moments
  never cross and are torch's own, unpinned); the optimizer's tensors on the GPU (0 expected) and
  the device bytes the setting saved (memory_allocated after the steps, none minus cpu) against
  the 8 bytes per parameter of AdamW's two moments.

Writes one JSON (--out; bench/gpu_check.sh folds it into memory_truth.json as "offload_gpu"),
rewritten after each section. On a CPU (--quick --device cpu, the tests' run) the same code runs
on the tiny model with the copies forced (Residency.moves): there is no memory_allocated, no
pinned memory and the key offload_residual_frac_gpu is None.

    python bench/offload_gpu.py --out $OUT/offload_gpu.json            # on the GPU
    python bench/offload_gpu.py --quick --device cpu --out /tmp/o.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_io import write_json  # noqa: E402
from bench.gpu_check import MOE_1B, MOE_TINY, device_of, device_parser  # noqa: E402

# The GPU's two AdamW kernels against each other, over STEPS updates in float32 (weights and
# compute, no TF32): CUDA's fused AdamW and the CPU's fused AdamW order the formula's operations
# differently, a few ulps of an update apart (2^-23 of a weight), and the forward and backward
# themselves differ by ulps run to run (atomics, module docstring). Such ulps move the loss by
# ~1e-7 of it, a router top-k choice flipped at a near-tie by ~1e-6 (one token's loss of 4,096);
# 1e-4 leaves two orders of margin, while a lost update (gradient not copied in, master not
# copied back) moves the loss by a step's change: the updates repeat one batch, whose loss falls
# by more than 10 x OPTIM_TOL at each (`min_loss_change`; the check fails otherwise).
OPTIM_TOL = 1e-4
# float32 throughout; on cuda the flash kernels take no float32 and flex would compile for a
# minute: the dense reference attention (float64 inside, deterministic) and torch's ops (no
# float32 Triton compile) serve, since the optimizer is what is compared
OPTIM_SETS = ["train.param_dtype=fp32", "train.autocast_dtype=none", "execution.attention_backend=reference",
              "execution.kernels=torch"]
STEPS = 5
LOSS_SETS = ["optim.lr=1e-3", "optim.warmup_steps=0", "optim.schedule=constant", "optim.weight_decay=0.1",
             "optim.grad_clip=1.0"]
FULL = {"model": {**MOE_1B, "num_layers": 2}, "tokens": 4096, "seqs": 8}
QUICK = {"model": MOE_TINY, "tokens": 512, "seqs": 4}


def policy_config(device: torch.device, sizes: dict, sets: list[str]):
    from longctx_moe.config import load_config

    autocast = "bf16" if device.type == "cuda" else "auto"  # a CPU without native bf16 emulates it
    base = [f"model.{k}={v}" for k, v in sizes["model"].items()]
    base += [f"train.device={device.type}", f"train.autocast_dtype={autocast}",
             f"data.micro_batch_tokens={sizes['tokens']}", *LOSS_SETS]
    return load_config(None, base + sets)


def rollouts(sizes: dict, vocab: int, seed: int):
    """`seqs` sequences of `tokens` in all, random ids, a quarter of each the prompt, advantage 1
    on the response tokens."""
    from rl_hooks.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    n = sizes["tokens"] // sizes["seqs"]
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(sizes["seqs"])]
    prompts, responses = [s[:n // 4] for s in seqs], [s[n // 4:] for s in seqs]
    return RolloutBatch.from_sequences(prompts, responses, advantages=[[1.0] * len(r) for r in responses])


def _loss():
    from rl_hooks import PolicyLossConfig, make_loss

    return make_loss(PolicyLossConfig(kind="pg"))


def _policy(device: torch.device, sizes: dict, sets: list[str]):
    from rl_hooks import PolicyTrainer

    torch.manual_seed(0)
    policy = PolicyTrainer(policy_config(device, sizes, sets))
    policy.export_gate.residency.moves = True  # on a CPU (the quick run) the copies are forced
    return policy


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _warm(device: torch.device) -> None:
    """cuBLAS's workspace for this stream exists before the first baseline is read (it stays
    allocated for the process's life, whoever made it)."""
    if device.type == "cuda":
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.ones(64, 64, device=device, dtype=dtype)
            a @ a
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()  # a trainer held in reference cycles would count in the next measurement
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _storages(policy) -> list[torch.UntypedStorage]:
    from rl_hooks.offload import PARTS, trainer_storages

    found = trainer_storages(policy.trainer, policy.export_gate.residency.device)
    return [s for part in PARTS for s in found[part]]


def snapshot(policy) -> list[torch.Tensor]:
    """Host copies of the bytes of every storage the trainer holds on its device (parameters,
    gradients, optimizer state), in the offload's walk order."""
    from rl_hooks.offload import _bytes

    return [_bytes(s).to("cpu", copy=True) for s in _storages(policy)]


def restore(policy, saved: list[torch.Tensor]) -> None:
    """Write `saved` (a snapshot of a trainer built alike) into this trainer's storages."""
    from rl_hooks.offload import _bytes

    mine = _storages(policy)
    if [s.nbytes() for s in mine] != [b.numel() for b in saved]:
        raise RuntimeError("the two trainers' storages differ in number or size: build them alike")
    for storage, data in zip(mine, saved, strict=True):
        _bytes(storage).copy_(data)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _frac(after: int | None, before: int | None, base: int = 0) -> float | None:
    return None if after is None or before is None else (after - base) / max(before - base, 1)


def _timed(device: torch.device, fn):
    t = time.perf_counter()
    out = fn()
    _allocated(device)  # drains the queue on cuda
    return out, time.perf_counter() - t


def round_trip(device: torch.device, sizes: dict, param_dtype: str) -> dict:
    """offload() / onload() between a backward and its step (module docstring)."""
    sets, loss = [f"train.param_dtype={param_dtype}"], _loss()
    _free(device)
    base = _allocated(device)
    moved = _policy(device, sizes, sets)
    vocab = moved.cfg.model.vocab_size
    b0, b1 = rollouts(sizes, vocab, 0), rollouts(sizes, vocab, 1)
    moved.train_step(b0, loss)  # the optimizer's state exists from here
    moved.forward_backward(b1, loss)  # gradients wait for their step
    residency = moved.export_gate.residency
    before, storages_before = _allocated(device), residency.device_bytes()
    start = snapshot(moved)
    sent, offload_s = _timed(device, moved.offload)
    after, storages_after = _allocated(device), residency.device_bytes()
    pinned = [h.host.is_pinned() for held in residency.held.values() for h in held if h.host is not None]
    back, onload_s = _timed(device, moved.onload)
    onloaded = _allocated(device)
    exact = _same(snapshot(moved), start)
    moved.optimizer_step()
    got = snapshot(moved)
    del moved, residency
    _free(device)
    plain = _policy(device, sizes, sets)
    plain.train_step(b0, loss)
    plain.forward_backward(b1, loss)
    restore(plain, start)  # the step starts from the bytes the moved trainer's did
    plain.optimizer_step()
    want = snapshot(plain)
    del plain
    _free(device)
    moved_bytes = sum(sent.values())
    return {"param_dtype": param_dtype, "allocated_base": base, "allocated_before": before,
            "allocated_after_offload": after, "allocated_after_onload": onloaded,
            "residual_frac": _frac(after, before), "residual_frac_net": _frac(after, before, base or 0),
            "storage_bytes_before": storages_before, "storage_bytes_after": storages_after,
            "sent_bytes": sent, "back_bytes": back, "host_buffers": len(pinned),
            "host_pinned": bool(pinned) and all(pinned), "offload_s": offload_s, "onload_s": onload_s,
            "offload_gb_per_s": moved_bytes / offload_s / 1e9, "onload_gb_per_s": moved_bytes / onload_s / 1e9,
            "bytes_back_exact": exact, "step_bitwise": _same(got, want)}


def _optimizer_tensors(opt) -> dict[str, list[torch.Tensor]]:
    """The optimizer's own tensors: AdamW's state, and for a HostAdamW its masters and the
    gradient buffers the device's gradients are copied into."""
    inner = getattr(opt, "optimizer", opt)
    out = {"state": [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]}
    if hasattr(opt, "_grads"):
        out["copy_buffers"] = [*opt.masters, *opt._grads]
    return out


def _bytes_on(tensors: list[torch.Tensor], kind: str) -> int:
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if t.device.type == kind}
    return sum(seen.values())


def optim_offload(device: torch.device, sizes: dict) -> dict:
    """optim.offload=cpu against none: losses, pinned host memory, device bytes (module docstring)."""
    loss, runs = _loss(), {}
    for offload in ("none", "cpu"):
        _free(device)
        base = _allocated(device)
        policy = _policy(device, sizes, [*OPTIM_SETS, f"optim.offload={offload}"])
        batch = rollouts(sizes, policy.cfg.model.vocab_size, 10)  # one batch: its loss falls at each update
        losses = [policy.train_step(batch, loss)["loss"] for _ in range(STEPS)]
        held = _allocated(device)
        mine = _optimizer_tensors(policy.trainer.optimizer)
        every = [t for ts in mine.values() for t in ts]
        run = {"losses": losses, "held_bytes": None if held is None else held - base,
               "params": sum(p.numel() for p in policy.trainer.model.parameters()),
               # the optimizer's tensors on a GPU (on a CPU run every tensor is the host's: 0)
               "optimizer_gpu_bytes": _bytes_on(every, "cuda"), "optimizer_host_bytes": _bytes_on(every, "cpu")}
        if "copy_buffers" in mine:  # the copies' host ends must be pinned to run asynchronously;
            # AdamW's moments never cross to the device (torch makes them, unpinned)
            run["copy_buffers_pinned"] = all(t.is_pinned() for t in mine["copy_buffers"])
            run["state_pinned"] = all(t.is_pinned() for t in mine["state"])
        runs[offload] = run
        del policy, mine, every
    _free(device)
    none, cpu = runs["none"], runs["cpu"]
    diffs = [abs(a - b) / abs(a) for a, b in zip(none["losses"], cpu["losses"], strict=True)]
    changes = [abs(b - a) / abs(a) for a, b in zip(none["losses"][:-1], none["losses"][1:], strict=True)]
    moments = 8 * none["params"]  # AdamW's two fp32 moments, which left the device
    saved = None if cpu["held_bytes"] is None else none["held_bytes"] - cpu["held_bytes"]
    out = {"none": none, "cpu": cpu, "max_rel_loss_diff": max(diffs), "tol": OPTIM_TOL,
           "min_loss_change": min(changes), "device_bytes_saved": saved, "adamw_moment_bytes": moments,
           "saved_over_moments": None if saved is None else saved / moments}
    # the comparison could not tell a lost update from rounding were the updates smaller than it
    checks = [out["max_rel_loss_diff"] <= OPTIM_TOL < out["min_loss_change"] / 10,
              cpu["optimizer_gpu_bytes"] == 0, cpu["optimizer_host_bytes"] >= 2 * moments]
    if device.type == "cuda":  # the moments' bytes left the device (90%: step scalars and such aside)
        checks += [cpu["copy_buffers_pinned"], out["saved_over_moments"] >= 0.9]
    out["ok"] = all(checks)
    return out


def headline(res: dict, device: torch.device) -> dict:
    """The issue's keys from the sections run so far."""
    trips = [v for k, v in res.items() if k.startswith("round_trip.") and "error" not in v]
    opt = res.get("optim_offload", {})
    fracs = [t["residual_frac"] for t in trips]
    return {"offload_residual_frac_gpu": max(fracs) if trips and None not in fracs else None,
            "offload_residual_frac_gpu_net": max((t["residual_frac_net"] for t in trips), default=None)
            if device.type == "cuda" else None,
            "offload_bitwise": bool(trips) and all(t["step_bitwise"] and t["bytes_back_exact"] for t in trips),
            "offload_host_pinned": bool(trips) and all(t["host_pinned"] for t in trips),
            "optim_offload_max_rel_loss_diff": opt.get("max_rel_loss_diff"),
            "optim_offload_host_pinned": opt.get("cpu", {}).get("copy_buffers_pinned"),
            "optim_offload_device_optimizer_bytes": opt.get("cpu", {}).get("optimizer_gpu_bytes"),
            "optim_offload_device_bytes_saved": opt.get("device_bytes_saved")}


def _guarded(fn, *args) -> dict:
    import traceback

    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - one failing section must not hide the other
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}


def _parser() -> argparse.ArgumentParser:
    ap = device_parser(__doc__.splitlines()[0], "the tiny model on 512 tokens (the CPU smoke run)")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    device = device_of(ap, args)
    sizes = QUICK if args.quick else FULL
    res: dict = {"device": str(device), "quick": args.quick, "model": sizes["model"], "tokens": sizes["tokens"],
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    _warm(device)
    res.update(headline(res, device))  # the keys first in the file
    sections = [(f"round_trip.{d}", round_trip, d) for d in ("fp32", "bf16")]
    for name, fn, *extra in [*sections, ("optim_offload", optim_offload)]:
        res[name] = _guarded(fn, device, sizes, *extra)
        if name.startswith("round_trip.") and "error" not in res[name]:
            r = res[name]
            r["ok"] = r["bytes_back_exact"] and r["step_bitwise"] and (
                device.type != "cuda" or (r["host_pinned"] and r["residual_frac"] <= 0.02))
        res.update(headline(res, device))
        print(f"{name:22s} ok={res[name].get('ok')} {res[name].get('error', '')}", flush=True)
        write_json(args.out, res, indent=2)  # a timeout later keeps what is done
    failed = [k for k, v in res.items() if isinstance(v, dict) and v.get("ok") is False]
    print("FAILED: " + ", ".join(failed) if failed else "offload checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
