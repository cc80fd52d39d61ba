"""Floors of a layout's per-rank memory from what is measured, without a probe: the walk's way
past layouts that come nowhere near fitting (plan.cli).

A cold plan would otherwise probe every layout it walks until K fit, and where few fit (a large
model on few GPUs) that is most of them, at seconds a probe. The measurements say which of a
layout's degrees its memory follows, and how: a rank's weights, gradients and optimizer state
are its share of the model's dense and expert parameters (dense / TP, experts / (EP x ETP), the
optimizer's over DP x CP and EDP too under the distributed optimizer; from another precision,
the weights and gradients alone); its bytes per token do
not move with the distributed optimizer and fall as 1 / TP (Qwen3-30B-A3B's probes: to 0.1%), and
with EP they stay (Qwen3-30B-A3B, EP 16-128) or grow (DeepSeek-V3's TP8 rank: 14 GiB of
activations at EP 8, 137 at EP 64), so they are carried from a smaller or equal EP only.
CP's backend, ETP and the precision change what is saved: carried with a margin each (the
precision from bf16 to fp32 parameters only); a recompute mode that keeps less is a floor as it
is. So a layout no probe has measured is estimated from the nearest measured one; the walk
measures it only where the estimate is within a margin of the GPU's memory (ESTIMATE_MARGIN,
and more per degree the estimate carries across), so every layout a plan proposes is
measured, never estimated.
"""

from __future__ import annotations

import json
import math

from longctx_moe.plan.layouts import Layout
from longctx_moe.plan.memory import (
    END_MISSING,
    MemoryCache,
    _activation_key,
    _extrapolate,
    _floor,
    _forward_precision,
    _model_activations,
    _peak,
    _precision,
    _probe_layout,
    _refused,
    _shrinks,
    _state_key,
    activations,
    static,
)

ESTIMATE_MARGIN = 0.10
# added to the margin when the estimate's activations come from a layout of another TP (scaled),
# CP backend (Ulysses' all-to-all buffers: +7% a token over ring's), ETP (taken as they are) or
# precision: bf16 parameters' activations stand for fp32 parameters' (which hold the bf16 copies
# autocast makes of their weights besides; Qwen3-30B-A3B's probes: a token's bytes within 1%,
# the fixed part 1.5x, at one layer a bf16 shrink 0.4% above its fp32 twin)
CARRY_MARGIN = {"tp": 0.05, "cp": 0.15, "etp": 0.25, "precision": 0.05}
# the precisions whose activations stand for another's: (parameters' dtype, FP8) -> those it
# may be carried from
CARRIED_PRECISION = {("fp32", False): ("bf16", False)}
# what each recompute mode keeps for the backward, in order: full (a block's input) below
# selective (all but the SwiGLU's) below none; a layout's activations are at least those of the
# same layout under a mode that keeps less
SAVES = {"full": 0, "selective": 1, "none": 2}


def _shares(layout: Layout, counts: tuple[int, int]) -> tuple[float, float]:
    """(parameters a rank holds, parameters its optimizer steps), from the model's (dense, expert)."""
    dense, expert = counts[0] / layout.tp, counts[1] / (layout.ep * layout.etp)
    if not layout.distributed_optimizer:
        return dense + expert, dense + expert
    return dense + expert, dense / (layout.dp * layout.cp) + expert / layout.edp


def _entries(cache: MemoryCache, kind: str):
    """(the fields of its key, the measurement) of each of the cache's measurements of `kind`."""
    for key, value in cache.entries.items():
        if key not in cache.fields:  # parsed once: a plan asks this of thousands of layouts
            try:
                fields = json.loads(key)
            except ValueError:
                fields = None
            cache.fields[key] = fields if isinstance(fields, dict) else {}
        if cache.fields[key].get("kind") == kind and not _refused(value):
            yield cache.fields[key], value


def _estimated_state(cache: MemoryCache, cfg, layout: Layout, counts) -> dict | None:
    """static() of `layout` from a measured layout, each category scaled by the rank's share of
    the parameters it follows: one of the same precision where there is one, else any, whose
    weights and gradients alone carry (_carried_weights)."""
    held, stepped = _shares(layout, counts)
    best = None
    for fields, value in _entries(cache, "state"):
        other = fields["precision"] != _precision(layout)
        world = fields["world"] or layout.world
        shape = Layout(fields["tp"], 1, "ring", 1, fields["ep"], fields["etp"], False, "none", fields["dopt"], world)
        o_held, o_stepped = _shares(shape, counts)
        rank = (other, not other and fields["dopt"] != layout.distributed_optimizer, abs(math.log(o_held / held)))
        if best is None or rank < best[0]:
            best = (rank, value, held / o_held, stepped / o_stepped, fields["precision"])
    if best is None:
        return None
    (other, *_), (first, second), held_ratio, stepped_ratio, precision = best
    measured = _extrapolate(first, second, _shrinks(cfg))
    follows_held = ("parameters", "gradients", "step parameters", "step gradients")
    state = {k: v * (held_ratio if k in follows_held else stepped_ratio) for k, v in measured.items()}
    return _carried_weights(state, precision[0], layout.param_dtype) if other else state


def _carried_weights(state: dict, measured_dtype: str, dtype: str) -> dict:
    """A floor of a rank's state from one measured in another precision: its weights and their
    gradients only (the optimizer's state and masters follow where AdamW steps and the dtype:
    none), at half the bytes from fp32 to bf16 parameters (no parameter is narrower than half
    its fp32 width) and the same bytes otherwise (bf16 parameters stand for fp32 ones as they
    are: the embedding, router and norms a bf16 run keeps in fp32 are as wide in either)."""
    width = 0.5 if (measured_dtype, dtype) == ("fp32", "bf16") else 1.0
    return {"parameters": state["parameters"] * width, "gradients": state["gradients"] * width,
            "optimizer state": 0.0}


def _estimated_activations(cache: MemoryCache, cfg, layout: Layout) -> tuple[dict, float] | None:
    """(activations() of `layout` from the nearest measured layout of the same recompute mode and
    precision, the margin its differences add), None where none is measured."""
    probe = _probe_layout(layout)
    # ring CP on 2 ranks holds a token's activations as no CP does (to 0.3%)
    own = _forward_precision(layout)
    want = {"tp": layout.tp, "cp": probe.cp_backend, "etp": probe.etp, "precision": own}
    usable = [own, list(CARRIED_PRECISION.get(tuple(own), own))]
    best = None
    for fields, value in _entries(cache, "activations"):
        if fields["precision"] not in usable or SAVES[fields["recompute"]] > SAVES[layout.recompute]:
            continue
        if fields["ep"] > probe.ep:  # a larger EP may hold more a token (DeepSeek-V3: 10x at 64 over 8)
            continue
        have = {**fields, "cp": fields["cp"].rstrip("0123456789")}
        carried = sum(CARRY_MARGIN[k] for k in want if have[k] != want[k])
        # the same mode first; a mode that keeps less is a floor as it is, the last resort
        rank = (fields["recompute"] != layout.recompute, carried)
        if best is None or rank < best[0]:
            best = (rank, value, fields["tp"] / layout.tp)
    if best is None:
        return None
    (_, carried), (first, second), tp_ratio = best
    measured = _model_activations(first, second, _shrinks(cfg))
    return {k: v if k.endswith("fixed") else v * tp_ratio for k, v in measured.items()}, carried


def estimate(cache: MemoryCache, cfg, layout: Layout, rank_tokens: int, micro_batches: int,
             counts: tuple[int, int], later_tokens: int = 0) -> tuple[dict, bool] | None:
    """(a floor of per_rank's figure for `layout` from what is measured, without a probe: the
    parts carried from other layouts lowered by their margins, its measured parts as they are;
    whether all of it is measured). A layout whose floor exceeds a GPU's memory cannot fit. None
    where nothing measured is near enough: the layout is then measured."""
    state_measured = cache.has(_state_key(layout))
    state = static(cache, cfg, layout) if state_measured else _estimated_state(cache, cfg, layout, counts)
    if state is None:
        return None
    state = {k: v * (1.0 if state_measured else 1 - ESTIMATE_MARGIN) for k, v in state.items()}
    if cache.has(_activation_key(layout)):
        return (_peak(state, activations(cache, cfg, layout, None), rank_tokens, micro_batches, later_tokens),
                state_measured)
    act = _estimated_activations(cache, cfg, layout)
    if act is None:  # no activations of a mode at or below its recompute mode: resident()'s floor
        return _floor(state), False
    per_token, carried = act
    # lowered by the margin, but the gradients not yet made (fewer of those is more memory)
    per_token = {k: v if k == END_MISSING else v * max(0.0, 1 - ESTIMATE_MARGIN - carried)
                 for k, v in per_token.items()}
    return _peak(state, per_token, rank_tokens, micro_batches, later_tokens), False
