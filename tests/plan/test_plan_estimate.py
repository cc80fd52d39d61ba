"""The floors a cold plan walks past layouts on (floors.estimate) stand below what the program
measures, and the plan measures every layout it proposes. A tiny model's layouts are measured
once for the module (on meta: seconds each); each test reads that cache."""

from __future__ import annotations

import json

import pytest

from longctx_moe.config import load_config
from longctx_moe.plan import floors, layouts, memory
from longctx_moe.plan.cli import length_source, param_counts, plan

WORLD = 4
TOKENS = 16384  # a rank's tokens: the activations matter beside the tiny model's state


def _tiny():
    return load_config("configs/tiny_cpu.yaml", ["train.autocast_dtype=bf16", "model.num_layers=3"])


def _layout(tp=1, cp=1, backend="ring", ep=4, recompute="selective", dopt=True, param_dtype="fp32"):
    return layouts.Layout(tp, cp, backend, cp, ep, 1, False, recompute, dopt, WORLD, param_dtype=param_dtype)


# One layout and its neighbours across each degree a floor is carried over: EP, the distributed
# optimizer, TP, CP's backend, the recompute mode (both ways), the parameters' dtype
FAMILY = [_layout(), _layout(ep=1), _layout(dopt=False), _layout(tp=2), _layout(cp=2, backend="ulysses"),
          _layout(recompute="full"), _layout(recompute="none"), _layout(param_dtype="bf16"),
          _layout(ep=1, param_dtype="bf16")]


def _family(c) -> bool:
    return c in FAMILY


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("plan-memory"))


@pytest.fixture(scope="module")
def measured(cache_dir):
    """(config, the family's layouts, a cache holding each one's measurements, the exact figures)."""
    cfg = _tiny()
    family = [c for c in FAMILY if layouts.judge(cfg, c) is None]
    assert family == FAMILY
    draw, _ = length_source("lognormal:256,0.5,1024")
    cache = memory.MemoryCache(cfg, cache_dir)
    exact = {c: sum(memory.per_rank(cache, cfg, c, TOKENS, draw).values()) for c in family}
    return cfg, family, cache, exact


def test_floors_stand_below_the_measured_figures(measured):
    """Fails if a floor carried from other layouts exceeds what the program measures for the
    layout: activations not scaled as 1/TP (or scaled the wrong way), a recompute mode that keeps
    more used as a floor, the margins dropped, the state not scaled by the rank's share."""
    cfg, family, cache, exact = measured
    counts = param_counts(cfg)
    seen = 0
    for layout in family:
        own = {memory._state_key(layout), memory._activation_key(layout)}
        held = {k: cache.entries.pop(k) for k in own}  # the layout as not yet measured
        try:
            floor = floors.estimate(cache, cfg, layout, TOKENS, 1, counts)
        finally:
            cache.entries.update(held)
        assert floor is not None and not floor[1], layout.label()
        seen += 1
        assert sum(floor[0].values()) <= exact[layout], (layout.label(), sum(floor[0].values()), exact[layout])
    assert seen == len(family)


def test_floors_are_close_where_only_ep_or_the_optimizer_differ(measured):
    """Fails if the floor is loose where the measurements say memory follows the degree exactly
    (a floor of zero would pass the test above and refuse nothing)."""
    cfg, family, cache, exact = measured
    counts = param_counts(cfg)
    for layout in (family[0], family[2]):  # each has a neighbour of no larger EP that differs in EP
        # or the optimizer alone
        own = memory._activation_key(layout)
        held = cache.entries.pop(own)
        try:
            floor, _ = floors.estimate(cache, cfg, layout, TOKENS, 1, counts)
        finally:
            cache.entries[own] = held
        assert sum(floor.values()) >= (1 - 2 * floors.ESTIMATE_MARGIN) * exact[layout], layout.label()


def test_a_cold_plan_measures_what_it_proposes_and_not_what_cannot_fit(monkeypatch, measured, cache_dir,
                                                                      tmp_path):
    """Fails if the walk proposes a layout on a floor (not measured), or measures every layout
    it walks (the floors unused)."""
    cfg = measured[0]
    monkeypatch.setattr(layouts, "candidates", lambda *a, **k: list(FAMILY))
    spec, tokens = "lognormal:4096,0.5,16384", 65536
    every = plan(cfg, WORLD, "h100", spec, tokens, top=len(FAMILY), cache_dir=cache_dir, memory_bytes=2**40)
    assert every["measured"] == 0 and len(every["fit"]) == len(FAMILY)  # the module's cache answered
    leanest = min(every["fit"], key=lambda p: p.peak)
    # a cold cache, and memory for the leanest layout alone
    result = plan(cfg, WORLD, "h100", spec, tokens, top=1, cache_dir=str(tmp_path), memory_bytes=int(leanest.peak))
    assert [p.layout for p in result["fit"]] == [leanest.layout]
    assert not result["fit"][0].estimated
    assert memory._activation_key(leanest.layout) in result["cache"].entries
    on_floors = [p for p in result["excluded"] if p.estimated]
    probed = {memory._activation_key(p.layout) for p in result["excluded"]} & set(result["cache"].entries)
    assert on_floors and len(probed) + 1 < len(FAMILY), ([p.layout.label() for p in on_floors], len(probed))


def test_a_rank_s_state_follows_its_share_of_the_parameters(measured):
    """Fails if a layout's weights and optimizer state are carried from another layout unscaled
    (or scaled by the wrong share): EP 1 against EP 4 holds four times the experts, without the
    distributed optimizer a rank steps all it holds."""
    cfg, family, cache, _ = measured
    counts = param_counts(cfg)
    # fp32 parameters: a bf16 run keeps its embedding, router and norms in fp32, a fifth of the
    # tiny model's parameters (of a real MoE's, well under 1%), so its bytes follow the parameter
    # count to 11% here, a floor all the same (the test above)
    for layout in (c for c in family if c.param_dtype == "fp32"):
        own = memory._state_key(layout)
        exact = memory.static(cache, cfg, layout)
        held = cache.entries.pop(own)
        try:
            carried = floors._estimated_state(cache, cfg, layout, counts)
        finally:
            cache.entries[own] = held
        for k in ("parameters", "optimizer state"):
            assert carried[k] == pytest.approx(exact[k], rel=floors.ESTIMATE_MARGIN), (layout.label(), k)


def test_a_layer_adds_memory_and_takes_none_away():
    """Fails if a figure the larger shrink holds less of is extrapolated downwards once per
    layer (Mixtral-8x22B's fixed activations went to -65 GiB that way, and the rank's peak
    under its rehearsal's by 8%)."""
    first = {"activations": 194e3, "activations fixed": 1.5e9}
    second = {"activations": 352e3, "activations fixed": 0.3e9}  # the peak fell elsewhere
    out = memory._extrapolate(first, second, (1, 2, 56))
    assert out["activations fixed"] == 1.5e9
    assert out["activations"] == pytest.approx(194e3 + 55 * 158e3)


def test_a_shrink_keeps_the_model_s_first_layers_settings():
    """Fails if a shrink keeps a per-layer list of the whole model (gpt-oss' sliding and full
    attention layers: the shrink's config is then refused and the plan stops)."""
    cfg = load_config("configs/tiny_cpu.yaml", ["model.num_layers=4", "model.sliding_window=64",
                                                "model.layer_types=[sliding_attention,full_attention,"
                                                "sliding_attention,full_attention]"])
    shrunk = memory._with_layers(cfg, 3)
    assert shrunk.model.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    from longctx_moe.config import validate

    validate(shrunk)


def test_a_layout_whose_rehearsal_stops_is_refused_with_the_reason(monkeypatch):
    """Fails if a layout the program refuses on the rehearsed GPU (a RuntimeError in its probe)
    stops the plan or is proposed."""
    cfg = _tiny()

    def stops(cache, cfg, layout, *a):
        if layout.tp == 2:
            raise RuntimeError("attention backend 'x' cannot do this on meta; use y\nmore")
        return {"parameters": 2**20}

    monkeypatch.setattr(layouts, "candidates", lambda *a, **k: list(FAMILY))
    monkeypatch.setattr(floors, "estimate", lambda *a, **k: None)
    monkeypatch.setattr(memory, "resident", stops)
    monkeypatch.setattr(memory, "per_rank", lambda *a, **k: {"parameters": 2**20})
    result = plan(cfg, WORLD, "h100", "lognormal:256,0.5,1024", 16384, top=len(FAMILY))
    refused = [p for p in result["excluded"] if p.layout.tp == 2]
    assert refused and refused[0].refused == "its rehearsal stopped: attention backend 'x' cannot do this on meta; use y"
    assert all(p.layout.tp != 2 for p in result["fit"]) and len(result["fit"]) == len(FAMILY) - 1


def test_a_refused_probe_is_kept_and_not_rehearsed_again(tmp_path):
    """Fails if a probe the program refuses is rehearsed again by every later plan (gpt-oss-120b's
    warm plans re-ran its refused ring-CP probes: 20 s), if the refusal is lost on the way (the
    layout would then be measured as fitting), if a floor is read from it, or if a worker's death
    is kept as the layout's refusal."""
    from longctx_moe.plan.probes import WorkerDied

    cfg = _tiny()
    calls = []

    def refused():
        calls.append(1)
        raise RuntimeError("sliding windows under ring CP want flex attention\nmore")

    for _ in range(2):  # the second cache reads the first's file
        cache = memory.MemoryCache(cfg, tmp_path)
        with pytest.raises(RuntimeError, match="^sliding windows under ring CP want flex attention$"):
            cache.get("probe", refused)
        assert not cache.has("probe")
    assert len(calls) == 1
    cache.entries[memory._key("activations", x=1)] = {"refused": "no"}
    assert list(floors._entries(cache, "activations")) == []

    def died():
        raise WorkerDied("a probe's worker process died")

    with pytest.raises(WorkerDied):
        cache.get("other", died)
    assert "other" not in cache.entries


def test_activations_are_carried_from_no_larger_ep():
    """Fails if a layout's bytes per token are carried from a layout of larger EP, which may hold
    many times more a token (DeepSeek-V3's TP8 rank: 10x at EP 64 over EP 8)."""
    cfg = _tiny()
    cache = memory.MemoryCache(cfg, None)
    per_layer = {"activations": 1000.0, "activations fixed": 0.0}
    cache.entries[memory._activation_key(_layout(ep=4))] = [per_layer, per_layer]
    assert floors._estimated_activations(cache, cfg, _layout(ep=2)) is None
    carried, margin = floors._estimated_activations(cache, cfg, _layout(ep=4, dopt=False))
    assert carried["activations"] == 1000.0 and margin == 0.0


def test_one_activation_probe_serves_adamw_on_the_device_and_on_the_host():
    """The activation probe stops where the update begins, so where AdamW runs does not enter its
    key. Fails if the key names the optimizer's placement (two probes where one serves), or if the
    program's forward / backward comes to depend on it (gradients moved to the host as the
    backward makes them would change the bytes, and the shared probe would then be wrong)."""
    cfg = _tiny()
    draw, _ = length_source("lognormal:256,0.5,1024")
    on_device = _layout(ep=2)
    on_host = layouts.Layout(**{**on_device.__dict__, "optimizer": "host"})
    assert layouts.judge(cfg, on_host) is None
    assert memory._activation_key(on_host) == memory._activation_key(on_device)
    assert memory._state_key(on_host) != memory._state_key(on_device)
    figures = []
    for layout in (on_device, on_host):
        probe = memory._probe_layout(layout)
        c = memory._with_layers(layouts.config_of(cfg, probe), memory._shrinks(cfg)[0])
        figures += memory._activation_bytes(memory.MemoryCache(cfg, None), [c], probe, draw)
    assert figures[0] == figures[1]


def test_probes_without_per_op_accounting_measure_the_same_memory():
    """The probes rehearse with the device rules counting collectives only (a quarter of a
    rehearsal's time). Fails if that changes what is measured: a host collective's result left
    as one rank's (shapes computed from it would change), communication buffers no longer filed
    apart, or the accounting left on (the launches counted)."""
    from longctx_moe.rehearsal.gpus import GPUS
    from longctx_moe.rehearsal.step import rehearse_rank

    cfg = _tiny()
    draw, _ = length_source("lognormal:256,0.5,1024")
    probe = memory._probe_layout(_layout(cp=2, ep=2))
    c = layouts.config_of(cfg, probe)
    full, lean = (rehearse_rank(c, probe.world, 0, GPUS["h100"], draw(8192), warmup=False, until_update=True,
                                accounting=a) for a in (True, False))
    assert lean.update_free_split == full.update_free_split and lean.peak_split == full.peak_split
    assert full.update_free_split["communication buffers"] > 0
    assert full.launches > 0 and lean.launches == 0
    assert lean.traffic == full.traffic  # the collectives are counted either way


def test_bf16_parameters_activations_are_a_floor_for_fp32_parameters(measured):
    """Fails if the carry goes the wrong way (fp32's activations, which add autocast's bf16 weight
    copies, taken as a floor for bf16's), or if it is dropped (the fp32 layout then has no
    activations to be estimated from and falls back to its state alone)."""
    cfg, family, cache, exact = measured
    counts = param_counts(cfg)
    fp32, bf16 = family[0], family[-2]
    acts = {k: v for k, v in cache.entries.items() if '"activations"' in k}
    keep = memory._activation_key(bf16)
    for k in acts:
        if k != keep:
            del cache.entries[k]
    try:
        floor, _ = floors.estimate(cache, cfg, fp32, TOKENS, 1, counts)
        assert floors.estimate(cache, cfg, bf16, TOKENS, 1, counts)[1]  # its own, measured
        assert floors._estimated_activations(cache, cfg, fp32) is not None
        cache.entries[memory._activation_key(fp32)] = acts[memory._activation_key(fp32)]
        del cache.entries[keep]
        assert floors._estimated_activations(cache, cfg, bf16) is None  # not from fp32's
    finally:
        cache.entries.update(acts)
    assert (1 - 2 * floors.ESTIMATE_MARGIN) * exact[fp32] <= sum(floor.values()) <= exact[fp32]


def test_another_precision_s_weights_are_a_floor_of_a_rank_s_state(measured):
    """With no state measured in a layout's own precision, its floor carries another's weights
    and gradients only: half the bytes from fp32 to bf16 parameters, the same from bf16 to fp32.
    Fails if fp32's bytes are carried to bf16 as they are (over what bf16 holds), if the
    optimizer's state is carried (fp32's moments are not bf16's masters and moments), or if
    nothing is (a floor of zero)."""
    cfg, family, cache, _ = measured
    counts = param_counts(cfg)
    for layout in (family[0], family[-2]):  # fp32 and bf16 parameters, the rest alike
        exact = memory.static(cache, cfg, layout)
        own = {k: v for k, v in cache.entries.items()
               if '"state"' in k and memory._precision(layout) == json.loads(k)["precision"]}
        for k in own:
            del cache.entries[k]
        try:
            carried = floors._estimated_state(cache, cfg, layout, counts)
        finally:
            cache.entries.update(own)
        assert carried["optimizer state"] == 0, layout.label()
        for k in ("parameters", "gradients"):
            assert 0.5 * exact[k] <= carried[k] <= exact[k], (layout.label(), k, carried[k], exact[k])
