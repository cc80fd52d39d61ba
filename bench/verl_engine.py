"""verl's engine path: the longctx_moe engine vs transformers + verl's functions + AdamW.

One GRPO batch (`--seqs` sequences, lengths log-uniform in [`--min-len`, `--max-len`], a prompt of
at most 64 tokens each, group-normalised advantages from verl's compute_grpo_outcome_advantage),
on the benchmark model of bench/rl_step.py (hidden 256, 4 layers, 16 experts top-2 of hidden 256,
4 query / 2 KV heads of 64, vocab 8192), made and saved by transformers; both sides load it.

Ours: verl's TrainingWorker (one rank, no Ray) with `strategy: longctx_moe`
(configs/verl_engine.yaml): `infer_batch` (old log-probs and entropies), then `train_mini_batch`
(one optimizer step with verl's ppo_loss), `max_token_len_per_gpu` = `--max-len`.
Theirs, the path verl's own engines take on one device: transformers' Qwen3-MoE forward (sdpa,
one sequence per micro-batch: verl removes padding), log-probs and entropies by verl's
`logprobs_from_logits` / `entropy_from_logits`, verl's `ppo_loss` per micro-batch with the global
token count, backward, gradient clipping and torch's AdamW.

Both sides compute in `--dtype`: float32 without autocast (the default: the comparison is exact
to float32 rounding), or bf16 autocast over float32 weights, the mixed precision verl's engines
train in (both sides' log-softmax in float32; the diffs are then bf16 rounding); neither side gets
a precision the other lacks. The same AdamW settings (lr 1e-6, eps 1e-8, clip 1.0, no weight
decay), router aux / z losses off on our side (transformers' forward adds none). Each side runs
in its own subprocess per round, alternating which goes first, scores the batch once untimed
(warm-up), then is timed; times are medians over rounds (the spread is min-max), tokens/s = real
tokens / median time; each round's own ratios (its two sides ran back to back) are listed too
(`*_tokens_per_s_ratio_by_round`). Peak memory: the subprocess's peak RSS
minus its RSS after imports, before the model is built. max_abs_logprob_diff compares the two
sides' infer log-probs; loss_abs_diff the step's loss (verl's own reduction on both sides).

    python bench/verl_engine.py --out bench/results/verl_engine.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/verl_engine.py`: bench/ would shadow the cp_attention package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
ROOT = _HERE.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from longctx_moe.host import resident_mb  # noqa: E402

MODEL = ["model.vocab_size=8192", "model.hidden_size=256", "model.num_layers=4", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=64", "model.num_experts=16", "model.top_k=2",
         "model.expert_hidden_size=256", "balance.aux_loss_coeff=0", "balance.z_loss_coeff=0",
         "train.param_dtype=fp32", "train.host_allocator=default"]
# --dtype: both sides compute in it; float32 master weights and AdamW either way.
AUTOCAST = {"float32": "none", "bf16": "bf16"}
LR, EPS, CLIP = 1e-6, 1e-8, 1.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=8, help="sequences in the GRPO batch")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--group", type=int, default=4, help="samples per prompt group")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    p.add_argument("--dtype", choices=sorted(AUTOCAST), default="float32",
                   help="compute dtype of both sides: float32, or bf16 autocast over float32 weights "
                        "(verl's engines train in bf16 mixed precision; native on AVX512-BF16 / AMX CPUs)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--worker", choices=("ours", "theirs"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def lengths(args) -> list[int]:
    """Log-uniform in [min_len, max_len], both ends included, fixed seed."""
    g = torch.Generator().manual_seed(0)
    lo, hi = torch.tensor(float(args.min_len)).log(), torch.tensor(float(args.max_len)).log()
    mid = (lo + (hi - lo) * torch.rand(max(args.seqs - 2, 0), generator=g)).exp().round().long().tolist()
    return sorted([args.min_len, args.max_len, *mid])[:args.seqs]


def grpo_batch(args):
    """verl's padded batch -> its no-padding TensorDict, advantages by verl's GRPO estimator."""
    import numpy as np
    from tensordict import TensorDict
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.workers.utils.padding import left_right_2_no_padding

    lens = lengths(args)
    g = torch.Generator().manual_seed(1)
    b = len(lens)
    prompt = [min(64, n // 2) for n in lens]
    p_max, r_max = max(prompt), max(n - p for n, p in zip(lens, prompt, strict=True))
    ids = torch.zeros(b, p_max + r_max, dtype=torch.long)
    mask, resp = torch.zeros_like(ids), torch.zeros(b, r_max, dtype=torch.long)
    for i, (n, p) in enumerate(zip(lens, prompt, strict=True)):
        ids[i, p_max - p:p_max + n - p] = torch.randint(0, 8192, (n,), generator=g)
        mask[i, p_max - p:p_max + n - p] = 1
        resp[i, :n - p] = 1
    scores = torch.rand(b, generator=g)
    adv, _ = compute_grpo_outcome_advantage(scores[:, None] * resp, resp,
                                            np.array([i // args.group for i in range(b)]))
    td = TensorDict({"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :p_max],
                     "responses": ids[:, p_max:], "response_mask": resp,
                     "position_ids": torch.clip(mask.cumsum(1) - 1, min=0),
                     "advantages": adv.float()}, batch_size=b)
    return left_right_2_no_padding(td)


def make_model(folder: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    from longctx_moe.config import load_config
    from longctx_moe.hf.interop import to_hf_config

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(to_hf_config(load_config(None, MODEL + ["train.autocast_dtype=none"]).model)).save_pretrained(folder)


def _rss_bytes() -> int:
    return int(resident_mb() * 2**20)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def ours_worker(args) -> dict:
    from functools import partial

    import torch.distributed as dist
    from omegaconf import OmegaConf
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from tests.launcher import free_port
    from tests.rl_hooks.verl_cases import actor_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    data = grpo_batch(args)
    yaml = OmegaConf.load(ROOT / "configs" / "verl_engine.yaml")
    yaml.model_config.path = args.folder
    yaml.engine_config.config = str(ROOT / "configs" / "tiny_cpu.yaml")
    yaml.engine_config.overrides = MODEL + [f"train.num_threads={args.threads}",
                                            f"train.autocast_dtype={AUTOCAST[args.dtype]}"]
    for key in ("max_token_len_per_gpu", "infer_max_token_len_per_gpu"):
        yaml.engine_config[key] = args.max_len
    yaml.engine_config.export_dtype = "float32"
    yaml.optimizer_config.update(lr=LR, eps=EPS, clip_grad=CLIP, weight_decay=0.0)
    parts = {k: omega_conf_to_dataclass(yaml[k]) for k in
             ("model_config", "engine_config", "optimizer_config", "checkpoint_config")}
    base = _rss_bytes()
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", **parts))
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor_config(entropy_coeff=0.0)))
    td = data.clone()
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=1.0)
    worker.infer_batch(td.clone())  # warm-up (first-call costs), untimed on both sides
    t0 = time.perf_counter()
    out = worker.infer_batch(td)
    infer_s = time.perf_counter() - t0
    lp = tu.get(out, "log_probs")
    data["old_log_probs"] = _response_values(lp, data)
    b = data.batch_size[0]
    tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=b, mini_batch_size=b, epochs=1,
                         seed=0, dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0)
    t0 = time.perf_counter()
    metrics = tu.get(worker.train_mini_batch(data), "metrics")
    train_s = time.perf_counter() - t0
    return {"infer_s": infer_s, "train_s": train_s, "loss": float(metrics["loss"][0]),
            "peak_mb": (_peak_bytes() - base) / 2**20, "logprobs": [x.tolist() for x in lp.unbind()]}


def _response_values(lp, data) -> torch.Tensor:
    """verl's old_log_probs [B, R] from nested shifted log-probs (its no_padding_2_padding)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(lp, data).float()


def theirs_worker(args) -> dict:
    import verl.utils.torch_functional as verl_F
    from transformers import AutoConfig, Qwen3MoeForCausalLM
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from tests.rl_hooks.verl_cases import actor_config

    torch.set_num_threads(args.threads)
    data = grpo_batch(args)
    base = _rss_bytes()
    cfg = AutoConfig.from_pretrained(args.folder)
    cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM.from_pretrained(args.folder, config=cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    rows = list(data["input_ids"].unbind())

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def score(ids, grad):
        with torch.set_grad_enabled(grad), autocast:
            # float32 log-softmax on both sides (ours computes its loss chunks in float32)
            logits = model(input_ids=ids[None]).logits[0].float()
            lp = verl_F.logprobs_from_logits(logits[:-1], ids[1:])
            ent = verl_F.entropy_from_logits(logits[:-1]) if not grad else None
        return torch.cat([lp, lp.new_zeros(1)]), ent

    for ids in rows:  # warm-up (first-call costs), untimed on both sides
        score(ids, False)
    t0 = time.perf_counter()
    lps = [score(ids, False)[0] for ids in rows]
    infer_s = time.perf_counter() - t0
    nested = torch.nested.nested_tensor_from_jagged(torch.cat(lps), data["input_ids"].offsets())
    data["old_log_probs"] = _response_values(nested, data)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()),
                         global_batch_size=data.batch_size[0])
    loss_cfg, total = actor_config(entropy_coeff=0.0), 0.0
    t0 = time.perf_counter()
    for i, ids in enumerate(rows):  # one sequence per micro-batch, verl's loss normalised globally
        lp, _ = score(ids, True)
        one = tu.index_select_tensor_dict(data, [i])
        nested_i = torch.nested.nested_tensor_from_jagged(lp, one["input_ids"].offsets())
        loss, _ = ppo_loss(loss_cfg, {"log_probs": nested_i}, one)
        loss.backward()
        total += float(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    train_s = time.perf_counter() - t0
    return {"infer_s": infer_s, "train_s": train_s, "loss": total,
            "peak_mb": (_peak_bytes() - base) / 2**20, "logprobs": [x.tolist() for x in lps]}


def run_side(side: str, args, folder: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--folder", str(folder), "--seqs", str(args.seqs),
           "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--group", str(args.group),
           "--threads", str(args.threads), "--dtype", args.dtype]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def summarize(results: dict, tokens: int) -> dict:
    def med(side, key):
        values = [r[key] for r in results[side]]
        return statistics.median(values), [min(values), max(values)]

    out = {"tokens": tokens, "rounds": len(results["ours"])}
    for side in ("ours", "theirs"):
        for key in ("infer_s", "train_s", "peak_mb"):
            out[f"{side}_{key}"], out[f"{side}_{key}_spread"] = med(side, key)
    a, b = results["ours"][0], results["theirs"][0]
    out["max_abs_logprob_diff"] = max(abs(x - y) for ra, rb in zip(a["logprobs"], b["logprobs"], strict=True)
                                      for x, y in zip(ra[:-1], rb[:-1], strict=True))
    out["loss_abs_diff"] = abs(a["loss"] - b["loss"])
    out["infer_tokens_per_s_ratio"] = out["theirs_infer_s"] / out["ours_infer_s"]
    out["train_tokens_per_s_ratio"] = out["theirs_train_s"] / out["ours_train_s"]
    out["peak_mem_ratio"] = out["ours_peak_mb"] / out["theirs_peak_mb"]
    # Each round's own ratio (its two sides ran back to back): the spread the machine's noise
    # leaves on the ratio itself, which the medians of the two sides alone do not show.
    for key in ("infer", "train"):
        out[f"{key}_tokens_per_s_ratio_by_round"] = [t[f"{key}_s"] / o[f"{key}_s"] for o, t in
                                                     zip(results["ours"], results["theirs"], strict=True)]
    return out


def table(r: dict) -> str:
    rows = [("", "ours (longctx_moe engine)", "transformers + verl fns"),
            ("infer s (median)", f"{r['ours_infer_s']:.2f}", f"{r['theirs_infer_s']:.2f}"),
            ("train step s (median)", f"{r['ours_train_s']:.2f}", f"{r['theirs_train_s']:.2f}"),
            ("peak MB", f"{r['ours_peak_mb']:.0f}", f"{r['theirs_peak_mb']:.0f}")]
    lines = [f"{a:<24}{b:>28}{c:>26}" for a, b, c in rows]
    lines += [f"tokens {r['tokens']}, rounds {r['rounds']}; max |logprob diff| {r['max_abs_logprob_diff']:.2e}, "
              f"|loss diff| {r['loss_abs_diff']:.2e}; ratios (ours over theirs): infer tokens/s "
              f"{r['infer_tokens_per_s_ratio']:.2f}, train tokens/s {r['train_tokens_per_s_ratio']:.2f}, "
              f"peak memory {r['peak_mem_ratio']:.2f}",
              "train tokens/s ratio by round: " + ", ".join(f"{x:.2f}" for x in r["train_tokens_per_s_ratio_by_round"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        fn = ours_worker if args.worker == "ours" else theirs_worker
        print(json.dumps(fn(args)))
        return 0
    from bench.bench_io import write_json

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        make_model(folder)
        results = {"ours": [], "theirs": []}
        for r in range(args.rounds):
            for side in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
                results[side].append(run_side(side, args, folder))
    res = summarize(results, sum(lengths(args)))
    res["config"] = {k: v for k, v in vars(args).items() if k not in ("worker", "folder", "out")}
    res["date"] = time.strftime("%Y-%m-%d")
    print(table(res))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
