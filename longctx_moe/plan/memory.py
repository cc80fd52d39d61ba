"""Per-rank memory of a layout, measured from the program on meta, not from a second formula.

Two measurements, each of a shrink of the model (its first_k_dense dense layers plus one, then
two MoE layers: the same shapes, fewer layers), cached on disk by what they depend on:

- Model state (`static`): the program builds and parallelizes the shrink for rank 0 of the real
  world (rehearsal.fake_world.build_rank: the program's own sharding over TP, EP, ETP), builds its
  optimizer (runtime.build_optimizer: AdamW, or the distributed optimizer's slabs over DP x CP and
  EDP) and steps it on zero gradients: once so that it allocates its state, once more under the
  rehearsal's memory tracker, which gives the optimizer step's peak (its gradients, state and
  the step's own temporaries). Keyed by (tp, ep, etp, distributed optimizer, and the world only
  with the distributed optimizer): CP does not shard weights.
- Activations (`activations`): rehearsal.step.rehearse_rank runs the shrink's whole step on a
  small world with the layout's TP, CP backend (on 2 ranks, hierarchical 2 x 2), EP, ETP and
  recompute mode at two token counts whose peak falls in the forward or
  backward; the activations, communication buffers and the rest there give bytes per token of
  the rank and a fixed part. Keyed by (recompute, tp, CP backend, EP, ETP).

A rank's peak is the largest of its step's moments (per_rank, _peak): a micro-batch's forward /
backward peak (parameters, optimizer state, its tokens' activations and receive buffers, and the
gradients earlier micro-batches accumulated), the backward's end (nearly every gradient beside
the first layers' activations: the probe's backward's own peak, whose gradients not yet made and
activations are those of the model's at the same layer), and the optimizer step. The step runs
one micro-batch's worth of each, so gradient accumulation adds only the gradients.

Scaling. Every MoE layer of a model has the same shapes, so the second shrink minus the first is
one MoE layer's share and the model's is the first plus (L - L0 - 1) of it (exact for weights).
Activations held for the backward grow by one layer's worth per layer under every recompute
mode (none: all its saved tensors; selective: those but the SwiGLU's; full: its input), and the
working set of the one layer being recomputed or differentiated is in the first shrink already.
They are linear in a rank's tokens: flash attention keeps O(tokens) per layer (no score matrix),
the experts' rows are tokens x top-k under the balanced routing the rehearsal assumes, and the
logits are per token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from longctx_moe.plan.layouts import Layout, config_of
from longctx_moe.plan.probes import Probes, WorkerDied

# Tokens per rank of an activation probe (and four times as many): meta tensors cost the same at
# any size; a rank's share of a micro-batch is rarely smaller.
PROBE_TOKENS = 8192
# What grows with a rank's tokens at the forward / backward peak: the saved tensors and the
# collectives' receive buffers (all-to-all, ring K/V, TP-SP gathers), and the rest.
TOKEN_CATEGORIES = ("activations", "communication buffers", "rest")
CATEGORIES = ("parameters", "gradients", "optimizer state") + TOKEN_CATEGORIES
# What the measurements are (their keys and how they are taken), in the cache's name: a cache of
# other measurements is not read
MEASURES = 9


def _precision(layout: Layout) -> list:
    """What of a layout's numerics shapes its memory: the parameters' dtype, FP8, where AdamW runs."""
    return [layout.param_dtype, layout.fp8, layout.optimizer]


def _forward_precision(layout: Layout) -> list:
    """What of its numerics shapes a layout's forward and backward: not where AdamW runs, which
    shapes only the update (an activation probe stops where the update begins; DeepSeek-V3's
    probes with AdamW on the host and on the GPU gave the same bytes to the byte)."""
    return [layout.param_dtype, layout.fp8]


def _key(kind: str, **fields) -> str:
    """A cache key that estimate() can read back: the measurement's kind and what it depends on."""
    return json.dumps({"kind": kind, **fields}, sort_keys=True)


def _shrinks(cfg) -> tuple[int, int, int]:
    """(layers of the first shrink, of the second, of the model)."""
    base = cfg.model.first_k_dense + 1
    return base, base + 1, cfg.model.num_layers


def _with_layers(cfg, layers: int):
    # per-layer settings (gpt-oss' sliding and full attention layers) as the model's first layers'
    types = cfg.model.layer_types[:layers] if cfg.model.layer_types else cfg.model.layer_types
    model = dataclasses.replace(cfg.model, num_layers=layers, first_k_dense=min(cfg.model.first_k_dense, layers),
                                layer_types=types)
    return dataclasses.replace(cfg, model=model)


def _extrapolate(first: dict, second: dict, layers: tuple[int, int, int]) -> dict:
    """The model's figures from its two shrinks': the first's, and the second's excess over it
    once per further MoE layer. A layer adds memory and takes none away: where a figure of the
    second is the smaller (its peak fell at another moment, and a per-token line's split into
    slope and fixed part moved), the layer adds none of it, rather than removing it 50 times."""
    extra = layers[2] - layers[0]
    return {k: first[k] + extra * max(0.0, second[k] - first[k]) for k in first}


class MemoryCache:
    """Measurements of one model and precision on disk (JSON), shared by every plan of it."""

    def __init__(self, cfg, directory: str | Path | None, rl: bool = False, probes: Probes | None = None):
        self.rl = rl  # the activation probes rehearse an RL policy's step (rehearse_step)
        self.probes = probes or Probes(1)  # where the measurements' rehearsals run
        what = json.dumps([MEASURES, dataclasses.asdict(cfg.model), dataclasses.asdict(cfg.execution),
                           cfg.train.param_dtype, cfg.train.autocast_dtype, cfg.optim.impl, rl], sort_keys=True,
                          default=str)
        digest = hashlib.sha256(what.encode()).hexdigest()[:16]
        self.path = Path(directory) / f"memory-{digest}.json" if directory else None
        self.entries = json.loads(self.path.read_text()) if self.path and self.path.is_file() else {}
        self.measured = 0  # measurements taken (not read from disk) by this process
        self.fields: dict[str, dict] = {}  # key -> what it says (floors._entries)

    def get(self, key: str, measure):
        """The measurement `key` names, taken by `measure()` once. A probe the program refuses on
        the rehearsed GPU (RuntimeError / ValueError: sliding windows under ring CP want flex
        attention, which meta lacks) is kept as such and raised again, not rehearsed again by
        every later plan; a worker's death (probes.WorkerDied) is not kept."""
        if key not in self.entries:
            try:
                self.entries[key] = measure()
            except WorkerDied:
                raise
            except (RuntimeError, ValueError) as e:
                self.entries[key] = {"refused": str(e).splitlines()[0] if str(e) else type(e).__name__}
            self.measured += 1
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.entries, indent=0))
                tmp.replace(self.path)
        value = self.entries[key]
        if _refused(value):
            raise RuntimeError(value["refused"])
        return value

    def has(self, key: str) -> bool:
        """Whether `key` is measured (not refused, nor yet to be taken)."""
        return key in self.entries and not _refused(self.entries[key])


def _refused(value) -> bool:
    """Whether a cache entry records a probe the program refused (a measurement is a list of the
    two shrinks' figures)."""
    return isinstance(value, dict) and "refused" in value


def _state_bytes(cfg, world: int) -> dict:
    """Rank 0 of `cfg` on `world` ranks: its parameters, gradients and optimizer state as the
    program holds them, and the categories at the peak of its update: the gradients a backward
    left reduced over their replicas (the all-reduce buckets or the distributed optimizer's
    reduce-scatter, their buffers filed as communication) and the optimizer's step (its own
    temporaries filed as activations, as the rehearsal files them)."""
    from longctx_moe.rehearsal.collectives import DeviceRules
    from longctx_moe.rehearsal.fake_world import build_rank, fake_world
    from longctx_moe.rehearsal.gpus import GPUS, as_cuda_device
    from longctx_moe.rehearsal.memtrack import (
        FastMemTracker,
        on_device,
        stepped_apart,
        torch_optimizer,
    )
    from longctx_moe.rehearsal.meta_device import cuda_kernels
    from longctx_moe.rehearsal.step import _groups, _split

    # as a rehearsal builds a rank: on the GPU it stands for (FP8's support is asked of it)
    with fake_world(world, 0), as_cuda_device(GPUS["h100"]):
        dims, runtime = build_rank(cfg, world, 0)
        model = runtime.model
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        with cuda_kernels():  # the optimizer picks its kernels as on the GPU: fused AdamW
            optimizer = runtime.build_optimizer(cfg.optim)
        inner = torch_optimizer(optimizer)
        names, _ = _groups(dims)

        def backward_done() -> None:  # the gradients as a backward leaves them
            for p in model.parameters():
                p.grad = torch.zeros_like(p)

        def update() -> None:
            runtime.reduce_gradients()
            optimizer.step()

        backward_done()
        with cuda_kernels(), DeviceRules(rank=0, group_names=names, accounting=False):
            update()  # the state AdamW (and a bf16 run's fp32 masters) allocate
        # on the device only (meta here): host AdamW's state and masters are in host memory
        masters = [t for t in stepped_apart(inner, model) if t.device.type == "meta"]
        device_state = masters + [t for s in inner.state.values() for t in s.values()
                               if torch.is_tensor(t) and t.dim() > 0 and t.device.type == "meta"]
        state = sum(t.numel() * t.element_size() for t in device_state)
        optimizer.zero_grad(set_to_none=True)
        backward_done()
        tracker = FastMemTracker()  # a steady-state update: what it holds at its peak
        tracker.track_state(model, optimizer)  # with a bf16 run's fp32 masters
        rules = DeviceRules(rank=0, group_names=names, accounting=False)  # memory is all it reads
        rules.on_buffers = tracker.mark_comm
        with cuda_kernels(), tracker, rules:
            update()
        snap = tracker.get_tracker_snapshot("peak")
    step = _split(on_device(snap))
    return {"parameters": params, "gradients": params, "optimizer state": state,
            **{f"step {k}": v for k, v in step.items()}}


def static(cache: MemoryCache, cfg, layout: Layout) -> dict:
    """Bytes of parameters, gradients and optimizer state one rank of `layout` holds."""
    # the world shapes a rank's state only through the distributed optimizer's shards (DP x CP
    # for dense weights, EDP for experts); without it one measurement serves every world
    key = _state_key(layout)
    layers = _shrinks(cfg)

    def measure():
        probe = dataclasses.replace(layout, cp=1, cp_backend="ring", cp_inner=1, dynamic_cp=False)
        c = config_of(cfg, probe)
        return cache.probes.run(_state_bytes, [(_with_layers(c, n), layout.world) for n in layers[:2]])

    first, second = cache.get(key, measure)
    return _extrapolate(first, second, layers)


def _state_key(layout: Layout) -> str:
    return _key("state", tp=layout.tp, ep=layout.ep, etp=layout.etp, dopt=layout.distributed_optimizer,
                world=layout.world if layout.distributed_optimizer else 0, precision=_precision(layout))


def _probe_layout(layout: Layout) -> Layout:
    """The small world whose rank runs the layout's activations: its TP, its CP backend on 2 ranks
    (hierarchical: 2 x 2; Ulysses on its own CP up to 4: its all-to-all regroups a rank's heads
    over the CP ranks' tokens, K/V replicated where a rank has fewer KV heads than CP ranks, so
    its buffers a token follow the CP size: gpt-oss-120b's TP2 x Ulysses CP4 was 17% over its
    rehearsal probed at CP 2, 10% at 4), its EP and ETP (a rank's routed rows and their buffers
    follow its EP: probed at EP 8, DeepSeek-V3's TP8 x EP64 rank came to 14 GiB of activations
    at 32K tokens where its rehearsal holds 137)."""
    ulysses = min(layout.cp, 4)
    cp, inner = {"ring": (2, 2), "ulysses": (ulysses, ulysses), "hierarchical": (4, 2)}[layout.cp_backend] \
        if layout.cp > 1 else (1, 1)
    world = max(layout.tp * cp, layout.ep * layout.etp)
    return dataclasses.replace(layout, cp=cp, cp_backend=layout.cp_backend if cp > 1 else "ring", cp_inner=inner,
                               dynamic_cp=False,
                               distributed_optimizer=layout.distributed_optimizer and world > 1, world=world)


def _activation_key(layout: Layout) -> str:
    probe = _probe_layout(layout)
    return _key("activations", recompute=layout.recompute, tp=layout.tp, cp=f"{probe.cp_backend}{probe.cp}",
                ep=probe.ep, etp=probe.etp, dopt=probe.distributed_optimizer, precision=_forward_precision(layout))


def rehearse_step(rl: bool):
    """The rehearsal of one rank's step: the trainer's (rehearsal.step.rehearse_rank), or with `rl`
    an RL policy's, which a package above this one registers (as `longctx-moe rehearse --rl`
    finds it: this package never imports rl_hooks)."""
    if not rl:
        from longctx_moe.rehearsal.step import rehearse_rank

        return rehearse_rank
    from longctx_moe.rehearsal.cli import _policy_step

    return _policy_step()


def _probe_splits(cfg, world: int, lengths: list[int], rl: bool) -> dict:
    """One rehearsal of an activation probe: rank 0's step of `lengths` on `world` ranks, its
    first step's forward and backward (no warm-up, stopped where the update begins: what a steady
    step holds there, but the optimizer's state, which the state probe measures). By category:
    the peak there ("peak": RankReport.update_free_split) and the backward's own
    ("backward": RankReport.backward_peak_split)."""
    from longctx_moe.rehearsal.gpus import GPUS

    report = rehearse_step(rl)(cfg, world, 0, GPUS["h100"], lengths, warmup=False, until_update=True,
                               accounting=False)
    return {"peak": report.update_free_split, "backward": report.backward_peak_split}


def _line(n1: int, n2: int, a: float, b: float) -> tuple[float, float]:
    """(bytes per token, fixed bytes) through a category's bytes `a` at `n1` tokens and `b` at
    `n2`: what does not grow with the tokens (workspaces, a layer's weights gathered) is a fixed
    part, not spread over the tokens. Where the two are not on a line with a slope and a fixed
    part of at least zero (the peak fell at another moment), the larger point's average."""
    slope = (b - a) / (n2 - n1)
    if slope < 0 or a - slope * n1 < 0:
        slope = b / n2
    return slope, max(0.0, b - slope * n2)


# The backward's-end moment's keys (_per_token): the token categories at the backward's peak,
# and the gradients not yet made there
END = "end "
END_MISSING = "end gradients missing"


def _per_token(tokens: tuple[int, int], splits: list[dict]) -> dict:
    """{category: bytes per token of a rank, f"{category} fixed": bytes} at the forward /
    backward's peak from a shrink's probes at two token counts, the same of the backward's own
    peak (f"end {category}"), the gradients made before the peak ("gradients fixed": the lm
    head's, first in the backward) and those not yet made at the backward's peak
    (END_MISSING)."""
    (n1, n2), (a, b) = tokens, splits
    out = {}
    for k in TOKEN_CATEGORIES:
        out[k], out[f"{k} fixed"] = _line(n1, n2, a["peak"][k], b["peak"][k])
        out[f"{END}{k}"], out[f"{END}{k} fixed"] = _line(n1, n2, a["backward"][k], b["backward"][k])
    out["gradients fixed"] = a["peak"]["gradients"]
    # a bf16 or fp32 gradient is its parameter's size: the shrink's parameters are its gradients
    out[END_MISSING] = min(max(0.0, s["backward"]["parameters"] - s["backward"]["gradients"]) for s in splits)
    return out


def _activation_bytes(cache: MemoryCache, shrinks: list, probe: Layout, lengths_of) -> list[dict]:
    """_per_token of each of `shrinks` (the probe's configs), from rehearsals at PROBE_TOKENS and
    four times as many a rank, all run at once where the cache's probes have workers."""
    tokens = (PROBE_TOKENS, 4 * PROBE_TOKENS)
    # the longest first (more tokens, then more layers): the workers take them in order and the
    # short ones fill in behind
    order = [(i, j) for j in reversed(range(len(tokens))) for i in reversed(range(len(shrinks)))]
    tasks = [(shrinks[i], probe.world, lengths_of(tokens[j] * probe.cp), cache.rl) for i, j in order]
    splits = dict(zip(order, cache.probes.run(_probe_splits, tasks), strict=True))
    return [_per_token(tokens, [splits[i, j] for j in range(len(tokens))]) for i in range(len(shrinks))]


def _model_activations(first: dict, second: dict, layers: tuple[int, int, int]) -> dict:
    """The model's bytes per token from its two shrinks' (_per_token): at the forward / backward's
    peak, every layer's saved tensors (_extrapolate); the gradients made by then are the lm head's
    and a layer's, not one more per layer of the model. The backward's-end moment is the first
    shrink's as it is: a moment of its backward stands for the model's moment at the same layer
    (the same layers below it hold their activations and lack their gradients; those above have
    made theirs, which the state probe's gradients count, and freed their activations)."""
    out = _extrapolate(first, second, layers)
    out.update({k: v for k, v in first.items() if k.startswith(END) or k == "gradients fixed"})
    return out


def activations(cache: MemoryCache, cfg, layout: Layout, lengths_of) -> dict:
    """Bytes per token of a rank (its share of a micro-batch) and the fixed bytes, for the
    activations, the communication buffers and the rest."""
    probe = _probe_layout(layout)
    key = _activation_key(layout)
    layers = _shrinks(cfg)

    def measure():
        c = config_of(cfg, probe)
        return _activation_bytes(cache, [_with_layers(c, n) for n in layers[:2]], probe, lengths_of)

    first, second = cache.get(key, measure)
    return _model_activations(first, second, layers)


def resident(cache: MemoryCache, cfg, layout: Layout) -> dict:
    """A floor of the rank's peak that needs no activation probe (the state probe is cheap: no
    forward or backward is run): the update's measured moment, or the parameters, optimizer state
    and every gradient the backward's end holds, whichever is larger. A layout this alone
    overflows is refused without probing its activations."""
    return _floor(static(cache, cfg, layout))


def _floor(state: dict) -> dict:
    # the backward's end holds every gradient, whatever the micro-batches (_peak)
    held = {"parameters": state["parameters"], "optimizer state": state["optimizer state"],
            "gradients": state["gradients"]}
    step = {k: state.get(f"step {k}", 0) for k in CATEGORIES}
    return held if sum(held.values()) >= sum(step.values()) else step


def per_rank(cache: MemoryCache, cfg, layout: Layout, rank_tokens: int, lengths_of,
             micro_batches: int = 1, later_tokens: int = 0) -> dict:
    """category -> bytes one rank of `layout` holds at the step's peak, the largest of the
    program's step's moments (_peak). `rank_tokens`: its tokens in its step's first forward /
    backward; `later_tokens`: the most in a later one of the same micro-batch (Dynamic-CP's slots:
    passes); 0: none."""
    return _peak(static(cache, cfg, layout), activations(cache, cfg, layout, lengths_of), rank_tokens,
                 micro_batches, later_tokens)


def passes(cfg, layout: Layout, rank_tokens: int, micro: list[int]) -> tuple[int, int]:
    """(the most tokens a rank holds in the first forward / backward of a micro-batch, the most in
    a later one; 0: none). Without Dynamic-CP a micro-batch is one pass of `rank_tokens`. Under
    Dynamic-CP it is slots, each a forward and backward of its own: the program's scheduler
    (cp_attention.dynamic.schedule, with the cost model the runtime builds) places the documents
    `micro` of one replica's micro-batch on its CP ranks, each holding at most `rank_tokens` a
    slot (the program schedules every replica's together, over DP x CP ranks; the replicas hold
    alike documents, as the rehearsal assumes)."""
    if not layout.dynamic_cp or layout.cp == 1:
        return rank_tokens, 0
    from cp_attention.dynamic import schedule
    from cp_attention.dynamic_cost import padded_length
    from longctx_moe.parallel.parallelize import a2a_size, dynamic_cp_cost

    c = config_of(cfg, layout)
    sp = c.parallel.sequence_parallel
    cost = dynamic_cp_cost(c.model, c.parallel, a2a_size(c.parallel, layout.cp_inner))
    plan = schedule(micro, layout.cp, layout.cp, rank_tokens, cost, tp=layout.tp, sequence_parallel=sp)

    def most(slots) -> int:
        return max((sum(padded_length(micro[i], run.size, layout.tp, sp) for i in run.seq_indices) // run.size
                    for slot in slots for run in slot), default=0)

    return most(plan.slots[:1]), most(plan.slots[1:])


def _peak(state: dict, per_token: dict, rank_tokens: int, micro_batches: int, later_tokens: int = 0) -> dict:
    """per_rank's moments from a rank's state (static) and its bytes per token (activations),
    the largest:
    - the first forward / backward's peak, of `rank_tokens` tokens: parameters, optimizer state,
      the activations and receive buffers of those tokens, and the gradients made by then (the
      lm head's: gradients are made as the backward runs and freed after the optimizer's step);
    - a later one's (Dynamic-CP's later slots, `later_tokens`; with more micro-batches, the
      first pass again), beside every gradient. Its activations are the first pass's scaled by
      its tokens, where it holds fewer: the fixed part taken as growing with the tokens, a floor
      (the per-token line through the probes' 8K and 32K tokens a rank overshoots at a few
      hundred: gpt-oss-120b's 720-token slot holds 6 GiB, the line says 12);
    - the backward's end, where the layers above have made their gradients: the first shrink's
      backward's peak, with the gradients of every layer but those it had still to make (with
      more micro-batches or passes, every gradient), and after it every gradient made, none yet
      reduced (the distributed optimizer frees them only as it reduce-scatters, the all-reduce
      buckets hold them);
    - the update's measured peak.
    The forward / backward's peak holds every layer's activations, the backward's end the first
    layers' with nearly every gradient; a layer between holds fewer of either, and its moment
    lies on the line between the two."""
    def tokens(n: int, prefix: str = "") -> dict:
        return {k: per_token.get(f"{prefix}{k}", 0.0) * n + per_token.get(f"{prefix}{k} fixed", 0.0)
                for k in TOKEN_CATEGORIES}

    held = {"parameters": state["parameters"], "optimizer state": state["optimizer state"]}
    later = max(later_tokens, rank_tokens if micro_batches > 1 else 0)
    first = {**held, "gradients": per_token.get("gradients fixed", 0), **tokens(rank_tokens)}
    moments = [first]
    if later:
        scaled = {k: first[k] * later / max(1, rank_tokens) for k in TOKEN_CATEGORIES}
        moments.append({**held, "gradients": state["gradients"],
                        **{k: min(v, scaled[k]) for k, v in tokens(later).items()}})
    missing = 0.0 if later else per_token.get(END_MISSING, 0.0)
    moments.append({**held, "gradients": max(0.0, state["gradients"] - missing), **tokens(rank_tokens, END)})
    moments.append(_floor(state))  # every gradient made, or the update
    return max(moments, key=lambda m: sum(m.values()))
