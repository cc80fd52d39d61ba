"""Batch invariance of PolicyTrainer.compute_logprobs: does a sequence's log-prob depend on its
neighbours in the micro-batch?

An RL step compares log-probs of the same tokens computed in different batches (the rollout
engine's, the trainer's old and new policy, the reference model's); any dependence on packing
shows up as off-policy noise in the importance ratio. One target sequence (`--target-len`, random
ids of a fixed seed) is scored

  alone             by itself (the reference);
  after neighbour   behind a `--neighbour-len` sequence in the same micro-batch;
  before neighbour  in front of it, same micro-batch;
  separate micro    with the neighbour, under a token budget that puts each in its own micro-batch;
  with a twin       next to a sequence 20 tokens longer, which the attention planner runs with it
                    as one padded bucket (cp_attention/kernels/_buckets.py);
  in a crowd        among several longer sequences in one micro-batch, straddling the LM head's
                    1024-token chunk boundary;

in bf16 autocast (fp32 parameters, as in training), float32 and float64 (no autocast), on the
benchmark model of bench/train_throughput.py, eager by default (`--set train.compile=true` to
compile the blocks). Reported: max and mean |log-prob - alone| over the target's scored tokens.

Then the layers are probed one by one, in each precision (eager; packing twin + neighbour +
target, which combines the effects above): each RMSNorm, Linear, attention, router, MoE layer and
the LM head + log-prob is re-run on the packed micro-batch with the target's input rows replaced
by exactly the rows it received when the target ran alone; a non-zero difference in the target's output rows means that piece is not batch-invariant by itself
(it is not inherited from an earlier layer). Standalone kernel probes follow: a GEMM at different
row counts (1..3 rows included), an expert's grouped GEMM with 1..3 rows, and the attention
kernel with the target alone vs in a bucket with its twin.

    python bench/batch_invariance.py --out bench/results/batch_invariance.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/batch_invariance.py`: bench/ would shadow the cp_attention package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from bench.train_throughput import MODEL, model_config  # noqa: E402

PRECISIONS = {"bf16": ["train.autocast_dtype=bf16"],
              "fp32": ["train.autocast_dtype=none"],
              "fp64": ["train.autocast_dtype=none", "train.param_dtype=fp64"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-len", type=int, default=300)
    p.add_argument("--neighbour-len", type=int, default=700)
    p.add_argument("--crowd", default="850,1500,1200",
                   help="lengths of the other sequences of 'in a crowd' (the target follows the first: "
                        "850 makes it straddle the LM head's 1024-token chunk boundary)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (0 = torch's default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override, e.g. train.compile=true")
    p.add_argument("--no-probe", action="store_true", help="skip the per-layer and kernel probes")
    p.add_argument("--batch-invariant", choices=("off", "on"), default="off",
                   help="PolicyTrainer's batch_invariant mode (its default is on; off measures "
                        "the kernels as they are)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- the cases


def sequences(args) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(0)
    # The twin is just long enough that the attention planner puts it and the target in one
    # padded bucket (cp_attention/kernels/_buckets.py) instead of reading each in place.
    lens = {"target": args.target_len, "neighbour": args.neighbour_len, "twin": args.target_len + 20}
    lens.update({f"crowd{i}": int(n) for i, n in enumerate(args.crowd.split(","))})
    return {k: torch.randint(0, MODEL["vocab_size"], (n,), generator=g).tolist() for k, n in lens.items()}


def cases(args, seqs) -> list[tuple[str, list[str], int]]:
    """(name, sequence names in batch order, micro-batch token budget)."""
    t, n, w = args.target_len, args.neighbour_len, len(seqs["twin"])
    crowd = [k for k in seqs if k.startswith("crowd")]
    everything = sum(len(seqs[k]) for k in ["target", "neighbour", *crowd])
    return [("alone", ["target"], t),
            ("after neighbour", ["neighbour", "target"], t + n),
            ("before neighbour", ["target", "neighbour"], t + n),
            ("separate micro-batches", ["neighbour", "target"], max(t, n)),
            ("one attention bucket with a twin", ["twin", "target"], t + w),
            ("in a crowd", [crowd[0], "target", "neighbour", *crowd[1:]], everything)]


def make_batch(seqs, names):
    """RolloutBatch of the named sequences (first token as prompt, the rest as response)."""
    from rl_hooks.batch import RolloutBatch

    return RolloutBatch.from_sequences([seqs[k][:1] for k in names], [seqs[k][1:] for k in names])


def target_logprobs(policy, seqs, names) -> torch.Tensor:
    """The target's scored log-probs (all tokens but its first), float64 [L - 1]."""
    batch = make_batch(seqs, names)
    logp = policy.compute_logprobs(batch).logprobs.double()
    i = names.index("target")
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    return logp[a + 1:b]


def trainers(cfg, budgets, invariant: bool):
    """One PolicyTrainer per budget, all holding the first one's weights."""
    from rl_hooks.api import PolicyTrainer

    out = {}
    for b in sorted(set(budgets)):
        out[b] = PolicyTrainer(cfg, micro_batch_tokens=b, batch_invariant=invariant)
        first = next(iter(out.values()))
        out[b].runtime.model.load_state_dict(first.runtime.model.state_dict())
    return out


def precision_config(args, prec: str, *last: str):
    """The benchmark model's Config in precision `prec` (eager unless --set says otherwise)."""
    return model_config([*PRECISIONS[prec], "train.compile=false", f"train.num_threads={args.threads}",
                         "train.device=cpu", *args.overrides, *last])


def run_cases(args, seqs) -> dict[str, dict]:
    """{precision: {case: {max_abs_diff, mean_abs_diff, bitwise_equal}}} against 'alone'."""
    table = {}
    for prec in PRECISIONS:
        cfg = precision_config(args, prec)
        cs = cases(args, seqs)
        policies = trainers(cfg, [b for _, _, b in cs], args.batch_invariant == "on")
        ref = None
        table[prec] = {}
        for name, names, budget in cs:
            logp = target_logprobs(policies[budget], seqs, names)
            ref = logp if ref is None else ref
            d = (logp - ref).abs()
            table[prec][name] = {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                                 "bitwise_equal": bool(torch.equal(logp, ref)), "budget": budget,
                                 "order": names}
        print(f"{prec}: " + ", ".join(f"{k} {v['max_abs_diff']:.2e}" for k, v in table[prec].items()), flush=True)
    return table


# ---------------------------------------------------------------------- per-layer probes


def _kind(name: str, m: nn.Module) -> str | None:
    from longctx_moe.model.attention import Attention
    from longctx_moe.model.layers import RMSNorm
    from longctx_moe.model.moe import MoE, Router

    if isinstance(m, RMSNorm):
        return "RMSNorm (" + name.rsplit(".", 1)[-1] + ")"
    if isinstance(m, nn.Linear):
        return "Linear (" + name.rsplit(".", 1)[-1] + ")"
    for cls, kind in ((Attention, "attention (projections + kernel)"), (Router, "router (fp32 linear, softmax, top-k)"),
                      (MoE, "MoE layer (router + dispatch + expert GEMMs)")):
        if isinstance(m, cls):
            return kind
    return None


def _capture(policy, batch_mb):
    """Forward one micro-batch under the trainer's autocast, recording every probed module's
    (module, args, kwargs, output); returns (records by name, the shard)."""
    from longctx_moe.model.transformer import LogProbHead

    model, records, handles = policy.runtime.model, {}, []
    for name, m in model.named_modules():
        if _kind(name, m):
            def hook(mod, args, kwargs, out, name=name):
                records[name] = (mod, args, kwargs, out)
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        shard = policy.runtime.shard(batch_mb.packed)
        with torch.no_grad(), policy.trainer.autocast():
            policy.runtime.forward(shard, LogProbHead())
    finally:
        for h in handles:
            h.remove()
    return records, shard


def _first_tensor(x):
    return x[0] if isinstance(x, tuple) else x


def _rows_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def probe_layers(policy, seqs, args) -> dict[str, float]:
    """Per probed module kind: max |output rows of the target| when the packed micro-batch's
    target input rows are replaced by those of the target alone (max over layers)."""
    from longctx_moe.model.losses import chunked_token_logprobs
    from rl_hooks.microbatch import build_micro_batch

    # Twin + neighbour + target: the target shares an attention bucket with the twin, experts
    # get other row counts, and its rows straddle the LM head's chunk boundary at 1024.
    names = ["twin", "neighbour", "target"]
    alone = build_micro_batch(make_batch(seqs, ["target"]), [0], 1)
    packed = build_micro_batch(make_batch(seqs, names), [0, 1, 2], 1)
    rec_a, _ = _capture(policy, alone)
    rec_p, shard_p = _capture(policy, packed)
    off, n = len(seqs["twin"]) + len(seqs["neighbour"]), args.target_len
    res: dict[str, float] = {}
    with torch.no_grad(), policy.trainer.autocast():
        for name, (mod, args_p, kw_p, _) in rec_p.items():
            _, args_a, _, out_a = rec_a[name]
            x = args_p[0].clone()
            x[off:off + n] = args_a[0]
            out = _first_tensor(mod(x, *args_p[1:], **kw_p))
            kind = _kind(name, mod)
            res[kind] = max(res.get(kind, 0.0), _rows_diff(out[off:off + n], _first_tensor(out_a)))
        model = policy.runtime.model
        h_a, h_p = _first_tensor(rec_a["norm"][3]), _first_tensor(rec_p["norm"][3]).clone()
        h_p[off:off + n] = h_a
        w, chunk = model.output_weight(), model.ops.loss_chunk_tokens
        lp_a = chunked_token_logprobs(h_a, w, alone.packed.labels, chunk)[0]
        lp_p = chunked_token_logprobs(h_p, w, shard_p.batch.labels, chunk)[0]
        res["LM head + log-prob (chunked)"] = _rows_diff(lp_p[off:off + n], lp_a)
    return res


# ---------------------------------------------------------------------- kernel probes


def probe_kernels(args, dtype: torch.dtype) -> dict[str, float]:
    """Standalone kernels in `dtype`: the target's rows alone vs in the shapes packing gives them."""
    from cp_attention.kernels import varlen_attention
    from longctx_moe.model.grouped_gemm import grouped_matmul, with_padded_groups

    g = torch.Generator().manual_seed(1)
    d, f, n, off = MODEL["hidden_size"], MODEL["expert_hidden_size"], args.target_len, args.neighbour_len
    x = torch.randn(off + n, d, generator=g).to(dtype)
    w = (torch.randn(d, 2 * f, generator=g) / d**0.5).to(dtype)
    res = {f"GEMM [M, {d}] x [{d}, {2 * f}], M={n} alone vs {off + n} packed": _rows_diff((x @ w)[off:], x[off:] @ w),
           f"GEMM, M=1..3 rows vs the same rows among {n}": max(_rows_diff(x[:m] @ w, (x[:n] @ w)[:m]) for m in (1, 2, 3))}
    # One expert's rows when it gets 1..3 rows vs many (bf16 pads every group to >= 16 rows).
    e = MODEL["num_experts"]
    we = (torch.randn(e, d, 2 * f, generator=g) / d**0.5).to(dtype)
    run = lambda rows, c: with_padded_groups(lambda y, cc: grouped_matmul(y, we, cc), rows,  # noqa: E731
                                             torch.tensor([c] + [0] * (e - 1)))
    res["expert grouped GEMM, an expert with 1..3 rows vs 37"] = max(
        _rows_diff(run(x[:m], m), run(x[:37], 37)[:m]) for m in (1, 2, 3))
    # Attention: the target alone (one in-place bucket) vs sharing a padded bucket with its twin.
    hq, hkv, r, twin = MODEL["num_heads"], MODEL["num_kv_heads"], MODEL["head_dim"], args.target_len + 20
    q, k, v = (torch.randn(twin + n, h, r, generator=g).to(dtype) for h in (hq, hkv, hkv))
    alone = varlen_attention(q[twin:], k[twin:], v[twin:], *_cu([n]), n, n)[0]
    both = varlen_attention(q, k, v, *_cu([twin, n]), twin, twin)[0]
    res[f"attention kernel, alone vs one bucket with a {twin}-token sequence"] = _rows_diff(both[twin:], alone)
    return res


def _cu(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return cu, cu


# ---------------------------------------------------------------------- report


def machine(threads: int) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu_model": cpu,
            "threads": threads or torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def cases_table(table: dict) -> str:
    names = list(table["bf16"])
    lines = ["| case (target vs alone) | bf16 max | bf16 mean | fp32 max | fp32 mean | fp64 max |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in names:
        b, f, d = table["bf16"][c], table["fp32"][c], table["fp64"][c]
        lines.append(f"| {c} | {b['max_abs_diff']:.2e} | {b['mean_abs_diff']:.2e} | {f['max_abs_diff']:.2e} | "
                     f"{f['mean_abs_diff']:.2e} | {d['max_abs_diff']:.2e} |")
    return "\n".join(lines)


def probes_table(probes: dict[str, dict[str, float]]) -> str:
    """Rows: pieces (max over layers); columns: precisions; 0 = bitwise batch-invariant."""
    precs = list(probes)
    lines = ["| piece, fed the target's rows from its run alone | " + " | ".join(precs) + " |",
             "|---|" + "---:|" * len(precs)]
    for k in probes[precs[0]]:
        lines.append(f"| {k} | " + " | ".join(f"{probes[p][k]:.1e}" if probes[p][k] else "0"
                                               for p in precs) + " |")
    return "\n".join(lines)


def run_probes(args, seqs) -> dict[str, dict[str, float]]:
    from rl_hooks.api import PolicyTrainer

    kernel_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    out = {}
    for prec in PRECISIONS:
        # Eager: the probes hook modules, which compiled blocks would trace through.
        policy = PolicyTrainer(precision_config(args, prec, "train.compile=false"),
                               batch_invariant=args.batch_invariant == "on")
        out[prec] = {**probe_layers(policy, seqs, args), **probe_kernels(args, kernel_dtype[prec])}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = sequences(args)
    table = run_cases(args, seqs)
    varying = [c for c in table["bf16"] if c != "alone"]
    res = {"bf16_max_abs_diff": max(table["bf16"][c]["max_abs_diff"] for c in varying),
           "bf16_mean_abs_diff": max(table["bf16"][c]["mean_abs_diff"] for c in varying),
           "fp32_max_abs_diff": max(table["fp32"][c]["max_abs_diff"] for c in varying),
           "fp64_max_abs_diff": max(table["fp64"][c]["max_abs_diff"] for c in varying),
           "cases": table, "target_len": args.target_len, "neighbour_len": args.neighbour_len,
           "crowd": args.crowd, "batch_invariant": args.batch_invariant, "model": MODEL, "overrides": args.overrides, "machine": machine(args.threads)}
    print(f"\ntarget {args.target_len} tokens, neighbour {args.neighbour_len}, crowd {args.crowd}; "
          f"|log-prob - alone| over the target's {args.target_len - 1} scored tokens\n")
    print(cases_table(table))
    if not args.no_probe:
        res["probes"] = run_probes(args, seqs)
        print("\nmax |target output rows - alone| per piece (bf16: autocast; kernels in that dtype)\n")
        print(probes_table(res["probes"]))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
