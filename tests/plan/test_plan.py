"""The planner's choices move the right way, on a tiny model whose memory the program measures
(each measurement taken once per module, in a cache shared by its tests). Each test narrows the
candidates to the family its rule moves through, so the plan walks and measures only those."""

from __future__ import annotations

import math
import os

import pytest

from longctx_moe.config import load_config
from longctx_moe.plan import layouts, memory, timing
from longctx_moe.plan.cli import plan

MIB = 2**20
LARGE = 80 * 2**30


def _tiny(**model):
    sets = ["train.autocast_dtype=bf16"] + [f"model.{k}={v}" for k, v in model.items()]
    return load_config("configs/tiny_cpu.yaml", sets)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One memory cache for the module: the tests' families share their measurements."""
    return str(tmp_path_factory.mktemp("plan-memory"))


def _only(monkeypatch, keep):
    """The planner enumerates only the candidates `keep` accepts."""
    every = layouts.candidates
    monkeypatch.setattr(layouts, "candidates", lambda *a, **k: [c for c in every(*a, **k) if keep(c)])


def _plain(c) -> bool:
    """No recompute, ring CP, no Dynamic-CP, no distributed optimizer, no ETP, fp32 parameters and
    AdamW on the device: the axes these tests do not move."""
    return (c.recompute == "none" and c.cp_backend == "ring" and not c.dynamic_cp
            and not c.distributed_optimizer and c.etp == 1 and c.precision == "fp32")


def test_a_refused_layout_is_never_proposed(monkeypatch):
    """Fails if the plan proposes a layout the configuration refuses (judge() -> None, or the
    judge call dropped)."""
    # 6 heads: TP 4 splits them unevenly, so the configuration refuses every TP-4 layout; the
    # time model is made to rank them fastest, so the plan walks them first. Memory is stubbed
    # (a few MiB for every layout): this rule is the judge's, not the memory's.
    cfg = _tiny(num_heads=6, num_kv_heads=2)
    real = timing.step_time

    def tp4_first(model, gpu, gpu_kind, layout, work, counts):
        t = dict(real(model, gpu, gpu_kind, layout, work, counts))
        t["total_s"] /= 1000 if layout.tp == 4 else 1
        return t

    monkeypatch.setattr(timing, "step_time", tp4_first)
    monkeypatch.setattr(memory, "per_rank", lambda *a, **k: {"parameters": MIB})
    result = plan(cfg, 4, "h100", "lognormal:256,0.5,1024", 16384, top=3)
    assert len(result["fit"]) == 3
    proposed = [p.layout.label() for p in result["fit"]]
    assert all(p.layout.tp != 4 and layouts.judge(cfg, p.layout) is None for p in result["fit"]), proposed
    refused = [p for p in result["excluded"] if p.layout.tp == 4]
    assert refused and all(p.refused for p in refused), "the planted TP-4 layouts were not walked first"


def test_more_memory_fewer_model_parallel_splits(monkeypatch, cache_dir):
    """Fails if the fit check ignores memory (p.peak <= gpu memory always true)."""
    # The family: TP 1, CP 1, EP 1, 2 or 4. With memory just enough for its leanest layout the
    # plan must split the experts; with 80 GiB it need not.
    cfg = _tiny()
    _only(monkeypatch, lambda c: _plain(c) and c.tp == 1 and c.cp == 1)
    spec, tokens = "lognormal:256,0.5,1024", 16384
    every = plan(cfg, 4, "h100", spec, tokens, top=99, cache_dir=cache_dir, memory_bytes=LARGE)["fit"]
    lean = min(every, key=lambda p: p.peak)
    small = plan(cfg, 4, "h100", spec, tokens, top=1, cache_dir=cache_dir, memory_bytes=math.ceil(lean.peak))
    large = plan(cfg, 4, "h100", spec, tokens, top=1, cache_dir=cache_dir, memory_bytes=LARGE)
    assert small["fit"] and large["fit"]
    assert large["fit"][0].layout.model_parallel < small["fit"][0].layout.model_parallel


def test_longer_documents_more_cp(monkeypatch, cache_dir):
    """Fails if CP does not divide a rank's share of the longest document (cli.rank_tokens
    ignoring layout.cp)."""
    # The family: TP 1, EP 1, ring CP 1, 2 or 4. The memory is what the short documents' best
    # layout needs; a 16K-token document must then be split over CP ranks to fit.
    cfg = _tiny()
    _only(monkeypatch, lambda c: _plain(c) and c.tp == 1 and c.ep == 1)
    tokens = 65536
    short = plan(cfg, 4, "h100", "lognormal:256,0.5,1024", tokens, top=1, cache_dir=cache_dir,
                 memory_bytes=LARGE)["fit"][0]
    budget = math.ceil(short.peak)
    again = plan(cfg, 4, "h100", "lognormal:256,0.5,1024", tokens, top=1, cache_dir=cache_dir, memory_bytes=budget)
    long = plan(cfg, 4, "h100", "lognormal:256,0.5,16384", tokens, top=1, cache_dir=cache_dir, memory_bytes=budget)
    assert again["fit"] and long["fit"], "no layout fit"
    assert long["fit"][0].layout.cp > again["fit"][0].layout.cp


def test_gradients_held_at_the_forward_only_after_a_micro_batch(monkeypatch):
    """Fails if per_rank counts accumulated gradients with one micro-batch or drops them with
    several (micro_batches ignored), or if the optimizer step's moment or the backward's end is
    not compared."""
    layout = layouts.Layout(1, 1, "ring", 1, 1, 1, False, "none", False, 1)
    state = {"parameters": 10 * MIB, "gradients": 10 * MIB, "optimizer state": 20 * MIB,
             **{f"step {k}": v for k, v in {"parameters": 10 * MIB, "gradients": 10 * MIB,
                                             "optimizer state": 20 * MIB, "activations": 15 * MIB}.items()}}
    monkeypatch.setattr(memory, "static", lambda *a: state)
    monkeypatch.setattr(memory, "activations", lambda *a: {"activations": 1024.0, "activations fixed": MIB})
    one = memory.per_rank(None, None, layout, 32 * 1024, None, micro_batches=1)
    many = memory.per_rank(None, None, layout, 32 * 1024, None, micro_batches=4)
    assert one["gradients"] == 0 and one["activations"] == 33 * MIB, one
    assert many["gradients"] == 10 * MIB, many
    # with few tokens the optimizer step's moment (its temporaries) is the peak
    few = memory.per_rank(None, None, layout, 1024, None, micro_batches=1)
    assert sum(few.values()) == 55 * MIB and few["activations"] == 15 * MIB, few
    # an update lighter than the backward's end: its own peak's activations (1024 a token and
    # 1 MiB) beside every gradient but those still to be made there (1 MiB)
    state["step activations"] = 0
    per_token = {"activations": 1024.0, "activations fixed": MIB, "end activations": 1024.0,
                 "end activations fixed": MIB, memory.END_MISSING: MIB}
    monkeypatch.setattr(memory, "activations", lambda *a: per_token)
    end = memory.per_rank(None, None, layout, 1024, None, micro_batches=1)
    assert end == {"parameters": 10 * MIB, "optimizer state": 20 * MIB, "gradients": 9 * MIB,
                   "activations": 2 * MIB, "communication buffers": 0.0, "rest": 0.0}, end
    # with more micro-batches every gradient is there already
    assert memory.per_rank(None, None, layout, 1024, None, micro_batches=4)["gradients"] == 10 * MIB
    # and after the backward every gradient is held, whatever its peak lacked
    per_token[memory.END_MISSING] = 3 * MIB
    after = memory.per_rank(None, None, layout, 1024, None, micro_batches=1)
    assert after == {"parameters": 10 * MIB, "optimizer state": 20 * MIB, "gradients": 10 * MIB}, after


def test_a_later_pass_holds_every_gradient(monkeypatch):
    """Dynamic-CP's later slots (and the micro-batches after the first) run their forward and
    backward beside every gradient. Fails if later_tokens is ignored (the backward's end, 40 MiB,
    would be the peak) or if a later pass's activations are the per-token line's (2 MiB at 1,024
    tokens) rather than the first pass's scaled by its tokens (3 MiB x 1,024 / 2,048)."""
    layout = layouts.Layout(1, 2, "ring", 1, 1, 1, True, "none", False, 2)
    state = {"parameters": 10 * MIB, "gradients": 10 * MIB, "optimizer state": 20 * MIB}
    monkeypatch.setattr(memory, "static", lambda *a: state)
    monkeypatch.setattr(memory, "activations", lambda *a: {"activations": 1024.0, "activations fixed": MIB})
    peak = memory.per_rank(None, None, layout, 2048, None, micro_batches=1, later_tokens=1024)
    assert peak == {"parameters": 10 * MIB, "optimizer state": 20 * MIB, "gradients": 10 * MIB,
                    "activations": 1.5 * MIB, "communication buffers": 0.0, "rest": 0.0}, peak


def test_dynamic_cp_passes_are_the_program_s_slots():
    """memory.passes: a micro-batch without Dynamic-CP is one pass of the rank's tokens; under it,
    the program's scheduler's slots. One document that needs every CP rank and short ones beside
    it: the long one fills the first slot at its share, the short ones wait for a later one.
    Fails if the slots are not read from the scheduler (one pass) or a rank's share is taken
    over the run rather than a rank."""
    cfg = _tiny()
    static = layouts.Layout(1, 4, "ring", 1, 1, 1, False, "none", False, 4)
    assert memory.passes(cfg, static, 1024, []) == (1024, 0)
    dynamic = layouts.Layout(1, 4, "ring", 1, 1, 1, True, "none", False, 4)
    micro = [4000, 30, 20]
    first, later = memory.passes(cfg, dynamic, 1024, micro)
    assert 1000 <= first <= 1024 and 0 < later <= 64, (first, later)
    # a micro-batch that one rank holds whole is one pass at most of its tokens
    assert memory.passes(cfg, dynamic, 1024, [300, 200])[1] == 0


def test_a_rank_holds_the_longest_document_s_padded_share():
    """A dataset's longest document rarely divides by the CP run's padding (2 x CP x TP chunks
    with sequence parallelism): a rank sized at its unpadded share is one Dynamic-CP refuses
    (the scheduler raised out of the plan). Fails if rank_tokens leaves the padding out."""
    from longctx_moe.plan.cli import rank_tokens

    layout = layouts.Layout(2, 8, "ring", 1, 1, 1, True, "none", False, 16)
    n = rank_tokens(layout, 30001, 16)
    assert n == 3752, n  # 30001 padded to a multiple of 32 is 30016, over 8 ranks
    first, later = memory.passes(_tiny(), layout, n, [30001, 50])
    assert first == n and 0 < later <= 64, (first, later)


def test_lengths_from_a_packed_dataset(tmp_path, monkeypatch):
    """Fails if --lengths DATASET_DIR does not draw the dataset's own document lengths (the
    longest bounding CP, every drawn length one of the corpus'), or a bad directory is accepted."""
    import json

    import numpy as np

    from data_packing.loader import PackedDataset
    from data_packing.pipeline import PackArgs, pack
    from longctx_moe.plan.cli import length_source

    rng = np.random.default_rng(0)
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text("".join(json.dumps({"ids": rng.integers(0, 100, int(n)).tolist()}) + "\n"
                              for n in rng.integers(20, 900, 60)))
    out = tmp_path / "packed"
    pack(PackArgs(output=str(out), sources=[str(corpus)], ids_key="ids", vocab_size=100, seq_len=1024,
                  workers=1, progress=False))
    lengths = PackedDataset(str(out), verify_tokenizer=False).doc_lengths
    draw, longest = length_source(str(out))
    drawn = draw(20000)
    assert longest == lengths.max() and set(drawn) <= set(lengths.tolist()) and sum(drawn) >= 20000
    monkeypatch.setattr(memory, "per_rank", lambda *a, **k: {"parameters": MIB})
    result = plan(_tiny(), 4, "h100", str(out), 16384, top=2)
    assert result["fit"]
    with pytest.raises(ValueError, match="not a packed dataset"):
        length_source(str(tmp_path))


def test_rl_measures_the_policy_step(monkeypatch, tmp_path):
    """Fails if --rl is accepted and then ignored: its activation probes must rehearse the RL
    policy's step (the entry point rl_hooks registers), and its measurements be cached apart; or
    if a probe runs a warm-up step or the update (the probes read only what precedes the update) or
    counts each op's work, which it does not read."""
    from types import SimpleNamespace

    assert memory.rehearse_step(True).__name__ == "rehearse_policy_rank"
    seen, steps = [], []

    def fake(cfg, world, rank, gpu, lengths, warmup=True, until_update=False, accounting=True):
        steps.append((warmup, until_update, accounting))  # a probe's report: bytes grow with the tokens
        split = {"activations": 100 * sum(lengths), "communication buffers": 0, "rest": 0, "gradients": 0}
        return SimpleNamespace(peak_moment="Transformer (peak_fw)", peak_split=split, update_free_split=split,
                               backward_peak_split={**split, "parameters": 0})

    monkeypatch.setattr(memory, "rehearse_step", lambda rl: seen.append(rl) or fake)
    _only(monkeypatch, lambda c: _plain(c) and c.tp == 1 and c.cp == 1 and c.ep == 2)
    result = plan(_tiny(), 2, "h100", "lognormal:256,0.5,1024", 8192, top=1, cache_dir=str(tmp_path), rl=True)
    assert result["fit"] and seen and all(seen), seen
    # the first step, until its update (no warm-up), memory all it counts
    assert steps and set(steps) == {(False, True, False)}, steps
    assert memory.MemoryCache(_tiny(), tmp_path, rl=True).path != memory.MemoryCache(_tiny(), tmp_path).path


def test_the_floor_refuses_without_an_activation_probe(monkeypatch):
    """Fails if resident() is not a floor of per_rank() (the optimizer step's moment or the
    accumulated gradients left out), so the plan would skip layouts that fit or probe ones
    that cannot."""
    layout = layouts.Layout(1, 1, "ring", 1, 1, 1, False, "none", False, 1)
    state = {"parameters": 10 * MIB, "gradients": 10 * MIB, "optimizer state": 20 * MIB,
             "step parameters": 10 * MIB, "step gradients": 10 * MIB, "step optimizer state": 20 * MIB,
             "step activations": 15 * MIB}
    monkeypatch.setattr(memory, "static", lambda *a: state)
    monkeypatch.setattr(memory, "activations", lambda *a: {"activations": 64.0})
    for tokens in (1024, 1 << 20):
        for m in (1, 4):
            floor = sum(memory.resident(None, None, layout).values())
            assert floor <= sum(memory.per_rank(None, None, layout, tokens, None, m).values())
    assert sum(memory.resident(None, None, layout).values()) == 55 * MIB  # the step's moment
    state["step activations"] = 0  # the backward's end: every gradient with the weights and state
    assert memory.resident(None, None, layout) == {"parameters": 10 * MIB, "optimizer state": 20 * MIB,
                                                   "gradients": 10 * MIB}


def test_probes_in_worker_processes_measure_what_one_process_does(monkeypatch, tmp_path):
    """A cold plan's probes run over worker processes (`jobs`, `longctx-moe plan --jobs`). Fails
    if the workers' measurements differ from this process's (a task's arguments mixed up, a
    shrink's rehearsals paired with another's) or if they do not run there at all."""
    from longctx_moe.plan import probes

    cfg = _tiny()
    _only(monkeypatch, lambda c: _plain(c) and c.tp == 1 and c.cp == 2 and c.ep == 2)
    spec, tokens = "lognormal:256,0.5,1024", 16384
    here = plan(cfg, 4, "h100", spec, tokens, top=1, cache_dir=str(tmp_path / "one"), memory_bytes=LARGE)
    ran = []
    real_run = probes.Probes.run
    monkeypatch.setattr(probes.Probes, "run", lambda self, fn, tasks: ran.append(self._pool is not None) or
                        real_run(self, fn, tasks))
    there = plan(cfg, 4, "h100", spec, tokens, top=1, cache_dir=str(tmp_path / "two"), memory_bytes=LARGE, jobs=2)
    assert here["measured"] == there["measured"] == 2  # the layout's state and activation probes
    assert here["cache"].entries == there["cache"].entries
    assert ran and all(ran)  # the pool had started: the rehearsals went to the workers
    assert there["cache"].probes._pool is None  # and the plan ended its workers


def _started() -> None:
    """A worker's first task that imports nothing (the spawned worker imports this module)."""


def _die(*_) -> None:
    os._exit(3)


def test_workers_that_die_as_they_start_stop_the_plan_in_one_line():
    """Workers that die before their first task (a script that calls plan() without a main
    guard: each spawned worker imports it and dies) stop the plan with why; a worker that dies
    later refuses the layout being probed. Fails if the first is taken as one layout's refusal:
    the walk then spawned and lost workers for every layout it walked, and never ended."""
    from longctx_moe.plan import probes

    dying = probes.Probes(2, warm=_die)
    with pytest.raises(probes.WorkersUnavailable, match='__name__ == "__main__"'):
        dying.run(max, [(1, 2), (3, 4)])
    assert dying._pool is None
    later = probes.Probes(2, warm=_started)
    assert later.run(max, [(1, 2), (3, 4)]) == [2, 4]
    with pytest.raises(probes.WorkerDied):
        later.run(_die, [(), ()])  # tasks of no arguments are run too
    later.close()
