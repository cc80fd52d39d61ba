"""Per-token log-prob parity with transformers on random configs of every Hugging Face family.

For each family, N configs drawn at random (sizes, heads, KV heads, head dims, expert counts,
top-k, renormalisation, group-limited routing, MLA ranks, RoPE / YaRN parameters, sliding
windows, 2-4 layers...) that differ from tests/hf/families_cases.py's, each saved with
transformers' save_pretrained and loaded by ours (hf.load.load_hf_model). A few documents are
packed into one batch for our forward and run one by one through transformers'; reported per
family: the max |log-prob difference| in float32 (both models float32) and in float64 (both
models .double(), transformers' float32 casts lifted by hf_float64). Float64 tells a real
mismatch (>> 1e-10) from float32 rounding (~1e-13).

A token whose top-k experts differ between the two forwards in some layer is a route flip. A
flip at a near-tie (the gap between the last chosen and the first unchosen selection score, or
between the last chosen and first unchosen group score, under NEAR_TIE) is rounding deciding a
tie, not a bug: that log-prob and every later one of its document are reported apart
(`near_tie_flips`, `max_abs_diff_after_flip`) and left out of max_abs_diff, as are the route
differences they cause downstream. A flip with a wide gap before any near-tie of its document
is a mismatch (`route_mismatches`).

    python bench/family_parity.py --configs 4 --seed 0 --out bench/results/family_parity.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager, nullcontext  # noqa: E402

import torch  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from bench.family_configs import draw_config  # noqa: E402
from tests.hf.families_cases import (  # noqa: E402
    CASES,
    batch_docs,
    hf_float64,
    hf_token_logprobs,
    packed_logprobs,
    save_random,
)
from tests.model.helpers import packed_batch  # noqa: E402

TOL32 = 2e-5  # the family tests' tolerance
TOL64 = 1e-10  # float64 end to end: rounding only
NEAR_TIE = 1e-5  # a selection-score gap float32 rounding can close (scores are O(0.1..1))


def _layer_of(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def _ours_hook(store: dict, layer: int):
    def hook(router, args, out):  # out: (topk_idx_TK, topk_weight_TK, RouterAux)
        store.setdefault(layer, []).append((out[0], router, out[2].logits_TE))
    return hook


def _theirs_hook(store: dict, layer: int):
    def hook(experts, args):  # args: (hidden_states, top_k_index, top_k_weights), every family
        store.setdefault(layer, []).append(args[1].clone())
    return hook


@contextmanager
def _recording_routes(ours, hf):
    """Record every MoE layer's top-k experts: ours {layer: [(idx_TK, router, logits_TE)]} from
    our routers, transformers' {layer: [idx_TK per document]} from its experts' inputs."""
    from longctx_moe.model.moe import Router

    mine, theirs = {}, {}
    hooks = [m.register_forward_hook(_ours_hook(mine, _layer_of(name)))
             for name, m in ours.named_modules() if isinstance(m, Router)]
    hooks += [m.register_forward_pre_hook(_theirs_hook(theirs, _layer_of(name)))
              for name, m in hf.named_modules() if name.endswith("experts") and hasattr(m, "gate_up_proj")]
    try:
        yield mine, theirs
    finally:
        for h in hooks:
            h.remove()


def _selection_gap_T(router, logits_TE: torch.Tensor) -> torch.Tensor:
    """Per token, the smallest gap of a routing decision (transformers' rule: best groups by
    the sum of their two best selection scores, then top-k among the kept groups' experts)."""
    logits_TE = logits_TE.double()
    scores_TE = logits_TE.softmax(-1) if router.score == "softmax" else logits_TE.sigmoid()
    select_TE = scores_TE + router.expert_bias.double() if router.use_bias else scores_TE
    t, e = select_TE.shape
    gap_T = torch.full((t,), float("inf"), dtype=torch.float64)
    if router.groups > 1:
        group_TG = select_TE.view(t, router.groups, -1).topk(2, dim=-1).values.sum(-1)
        ranked_TG = group_TG.sort(-1, descending=True).values
        if router.topk_groups < router.groups:
            gap_T = ranked_TG[:, router.topk_groups - 1] - ranked_TG[:, router.topk_groups]
        select_TE = router._limit_to_groups(select_TE)  # the dropped groups' experts at -inf
    ranked_TE = select_TE.sort(-1, descending=True).values
    if router.top_k < e:
        gap_T = torch.minimum(gap_T, ranked_TE[:, router.top_k - 1] - ranked_TE[:, router.top_k])
    return gap_T


def _route_flips(mine: dict, theirs: dict, cu: list[int]) -> list[dict]:
    """Every (layer, token) whose expert set differs, with its document, position and gap."""
    flips = []
    for layer, [(idx_TK, router, logits_TE)] in sorted(mine.items()):
        ref_TK = torch.cat(theirs[layer]).to(idx_TK.device)
        differ_T = (idx_TK.sort(-1).values != ref_TK.sort(-1).values).any(-1)
        gap_T = _selection_gap_T(router, logits_TE)
        for t in differ_T.nonzero()[:, 0].tolist():
            doc = max(d for d in range(len(cu) - 1) if cu[d] <= t)
            flips.append({"layer": layer, "doc": doc, "pos": t - cu[doc], "gap": float(gap_T[t])})
    return flips


def _compare(ours, hf, batch, float64: bool) -> dict:
    """Max |log-prob difference| of our packed forward vs transformers' per document."""
    cu = batch.cu_seqlens.tolist()
    with _recording_routes(ours, hf) as (mine_routes, their_routes):
        with hf_float64(hf) if float64 else nullcontext():
            theirs = hf_token_logprobs(hf, batch_docs(batch))
        mine = packed_logprobs(ours, batch)
    flips = _route_flips(mine_routes, their_routes, cu)
    ties = [f for f in flips if f["gap"] < NEAR_TIE]
    first_tie = {}
    for f in ties:
        first_tie[f["doc"]] = min(first_tie.get(f["doc"], f["pos"]), f["pos"])
    kept, after = [0.0], [0.0]
    for d, (m, t) in enumerate(zip(mine, theirs, strict=True)):
        diff_T = (m - t).abs()
        cut = first_tie.get(d, len(diff_T))  # log-prob p reads the hidden state of token p
        kept += diff_T[:cut].tolist()
        after += diff_T[cut:].tolist()
    # Past a near-tie flip the hidden states differ for real, so routes may differ by wide gaps.
    wide = [f for f in flips if f["gap"] >= NEAR_TIE and f["pos"] < first_tie.get(f["doc"], f["pos"] + 1)]
    return {"max_abs_diff": max(kept), "near_tie_flips": ties, "max_abs_diff_after_flip": max(after),
            "logprobs_after_flip": len(after) - 1, "route_mismatches": wide}


def run_config(family: str, kwargs: dict, doc_lens: list[int], seed: int, workdir: Path) -> dict:
    from longctx_moe.hf.load import load_hf_model

    path = workdir / f"{family}-{seed}"
    hf = save_random(family, kwargs, path, seed=seed)
    ours = load_hf_model(path)
    batch = packed_batch(doc_lens, ours.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    out32 = _compare(ours, hf, batch, float64=False)
    out64 = _compare(ours.double(), hf.double(), batch, float64=True)
    return {"kwargs": kwargs, "doc_lens": doc_lens, "seed": seed, "float32": out32, "float64": out64}


def _verdict(worst32: float, worst64: float) -> str:
    """float64 decides: a difference that survives it is a mismatch, one that does not is float32
    rounding, whatever its size in float32."""
    if worst64 > TOL64:
        return "mismatch"
    return "ok" if worst32 <= TOL32 else "float32 rounding over tolerance"


def run_family(family: str, n: int, rng: random.Random, workdir: Path) -> dict:
    configs = []
    for _ in range(n):
        kwargs = draw_config(family, rng, avoid=CASES[family])
        doc_lens = [rng.randint(1, 32) for _ in range(rng.randint(2, 5))]
        configs.append(run_config(family, kwargs, doc_lens, rng.randrange(1 << 16), workdir))
    worst32 = max(c["float32"]["max_abs_diff"] for c in configs)
    worst64 = max(c["float64"]["max_abs_diff"] for c in configs)
    return {"max_abs_diff_float32": worst32, "max_abs_diff_float64": worst64,
            "verdict": _verdict(worst32, worst64),
            "near_tie_flips_float32": sum(len(c["float32"]["near_tie_flips"]) for c in configs),
            "route_mismatches": sum(len(c[p]["route_mismatches"]) for c in configs for p in ("float32", "float64")),
            "configs": configs}


def _table(families: dict) -> str:
    head = f"{'family':<12} {'configs':>7} {'max|dlogp| fp32':>16} {'max|dlogp| fp64':>16} " \
           f"{'tie flips':>9} {'after-flip fp32':>15} {'route mism.':>11}  verdict"
    rows = [head, "-" * len(head)]
    for fam, r in families.items():
        after = max(c["float32"]["max_abs_diff_after_flip"] for c in r["configs"])
        rows.append(f"{fam:<12} {len(r['configs']):>7} {r['max_abs_diff_float32']:>16.3e} "
                    f"{r['max_abs_diff_float64']:>16.3e} {r['near_tie_flips_float32']:>9} {after:>15.3e} "
                    f"{r['route_mismatches']:>11}  {r['verdict']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=int, default=4, help="random configs per family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--families", default=",".join(CASES), help="comma-separated model_types")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one "Writing model shards" bar per config
    start = time.perf_counter()
    families = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families.split(","):
            families[fam] = run_family(fam, args.configs, random.Random(f"{args.seed}-{fam}"), Path(tmp))
    ok = all(r["max_abs_diff_float32"] <= TOL32 and r["max_abs_diff_float64"] <= TOL64 and not r["route_mismatches"]
             for r in families.values())
    print(_table(families))
    print(f"tolerance float32 {TOL32:g}, float64 {TOL64:g}; near-tie flips (gap < {NEAR_TIE:g}) excluded; "
          f"{'all within' if ok else 'NOT all within'} ({time.perf_counter() - start:.0f} s)")
    write_json(args.out, {**families, "tolerance_float32": TOL32, "tolerance_float64": TOL64,
                          "near_tie_gap": NEAR_TIE, "all_within_tolerance": ok, "seed": args.seed,
                          "configs_per_family": args.configs})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
