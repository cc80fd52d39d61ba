"""Dynamic-CP scheduler: give each sequence of one step the smallest context-parallel sub-group it
fits in, and place the sequences on the ranks of a DP x CP block, micro-batch slot by slot (pure
Python, deterministic, no communication; the runtime all-gathers the lengths and every rank runs
the same call).

API (cost: a cp_attention.dynamic_cost.DynamicCPCost)
    plan = schedule(lengths, block_size, max_cp, capacity_tokens, cost, static_cp=None,
                    tp=1, sequence_parallel=False, raise_cp=True) -> DynamicPlan
    plan.slots[m]             list of Run(size, first_rank, seq_indices), ordered by first_rank:
                              a partition of ranks 0..block_size-1 (an idle rank is Run(1, r, ()))
    plan.assignment(rank)     [(run, seq_indices)] over the slots: what `rank` runs in each slot
    plan.num_slots, plan.rank_cost, plan.imbalance, plan.cp_bytes, plan.modeled_step_time,
    plan.cp_sizes_used

Layout. The block holds B = dp * cp ranks. For every power of two s <= max_cp the ranks are cut
into aligned runs [j*s, (j+1)*s). A slot is one micro-batch index: in a slot every rank belongs to
exactly one run, and each run holds a packed list of sequences, each sharded (zigzag) over the
run's s ranks, its length padded as the runtime pads it (padded_length: lcm(2s, tp), or lcm(2s,
s*tp) with sequence parallelism; tp on one rank). Every rank runs num_slots slots.

Cost model: cp_attention/dynamic_cost.py (DynamicCPCost): a sequence's compute, ring bytes and
attention tile overhead on s ranks, and a run's fixed ring-step latency.

Step-time model. The MoE all-to-alls make every rank of the block wait for the others inside
every slot, so a step takes sum over slots of (max over the slot's runs of the run's cost), and
a run's cost is its fixed cost plus the sum of its sequences' costs. `imbalance` is max/mean of the per-rank cost.

Algorithm. (1) Each sequence gets the smallest power-of-two s <= max_cp whose per-rank share fits
capacity_tokens. (2) Sequences go, densest first (seconds per token held; ties by index), to the
option that raises the step time least: a new run on free ranks of an open slot, an existing run
with room (tokens) in any open slot, or (raise_cp) an existing larger run, where the sequence is
sharded over more ranks than it needs. Ties prefer the smallest size, then the earliest slot,
then the lowest resulting run cost (LPT), then the lowest rank; a new slot opens only when every
other option raises the step time more. With raise_cp: (3) in a slot with idle ranks, the run that sets
the slot's time is doubled onto free ranks while that lowers its cost (one long sequence on a
small block then spreads over max_cp ranks); a slot that ends no faster is left as it was.
(4) Each slot's sequences are packed again with every size floor 2, 4, ..., max_cp; a packing
that fits the one slot and is at least _MIN_GAIN (1%) faster replaces it. Three candidate plans are
made: (2)-(4) without, then with, the larger existing runs of (2) (a raise lowers the slot's time
now but takes room later sequences need; neither wins on every mix), then the static plan on
max_cp; a later one replaces an earlier one only if it is at least _MIN_GAIN faster, so the plan
is never slower than static CP at max_cp by more than that. (5) Runs below their slot's time are
halved while their sequences fit the halves without passing it: same step time, fewer bytes.
static_cp replaces (1) and (3)-(5): every sequence on a run of exactly static_cp ranks.

Legend: B block ranks, N sequences, M slots, s run size, n padded length, C capacity_tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cp_attention.dynamic_cost import DynamicCPCost, padded_length
from cp_attention.dynamic_slot import OpenRun, Slot
from data_packing.batch import pad_multiple, pad_to

# A packing on larger runs (step 4, and the later candidate plans) is adopted only if it is at
# least this much faster: the cost model charges larger runs their ring bytes, ring steps and
# smaller attention tiles but not their contention with the MoE all-to-all, so a gain smaller
# than the model's error is not worth the traffic.
_MIN_GAIN = 0.01
_EPS = 1e-9  # relative float noise of summed costs


@dataclass(frozen=True)
class Run:
    """Ranks [first_rank, first_rank + size) of one slot and the sequences they share."""

    size: int
    first_rank: int
    seq_indices: tuple[int, ...]

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.size)


@dataclass
class DynamicPlan:
    """One step's placement (module docstring). rank_cost: float64 [B] seconds per rank over all
    slots; slot_seconds[m]: cost of slot m's slowest run; cp_bytes: ring bytes received by all
    ranks together; cp_sizes_used: run size -> number of sequences, ascending sizes."""

    slots: list[list[Run]]
    rank_cost: np.ndarray
    slot_seconds: list[float]
    cp_bytes: float
    cp_sizes_used: dict[int, int]
    _by_rank: list[list[Run]] = field(default_factory=list, repr=False, compare=False)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def modeled_step_time(self) -> float:
        return float(sum(self.slot_seconds))

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_cost.mean()) if self.rank_cost.size else 0.0
        return float(self.rank_cost.max()) / mean if mean > 0 else 1.0

    def assignment(self, rank: int) -> list[tuple[Run, tuple[int, ...]]]:
        """For every slot, the run that `rank` belongs to and the sequences it runs there."""
        if not 0 <= rank < len(self.rank_cost):
            raise ValueError(f"assignment: rank {rank} is outside the block of "
                             f"{len(self.rank_cost)} ranks")
        if not self._by_rank:
            self._by_rank = [[] for _ in self.rank_cost]
            for runs in self.slots:
                for run in runs:
                    for r in run.ranks:
                        self._by_rank[r].append(run)
        return [(run, run.seq_indices) for run in self._by_rank[rank]]


@dataclass
class _Problem:
    """Per-sequence tables of one schedule() call: options[i] = [(size, tokens per rank,
    seconds)] for the sizes sequence i may use, smallest first."""

    lengths: list[int]
    options: list[list[tuple[int, int, float]]]
    block_size: int
    sizes: list[int]  # run sizes the slots are cut into: 1, 2, ..., top
    capacity: int
    tp: int
    sequence_parallel: bool
    cost: DynamicCPCost

    min_room: dict[int, int] = field(init=False)  # size -> fewest tokens per rank of a sequence
    fixed: dict[int, float] = field(init=False)  # size -> fixed seconds of a busy run

    def __post_init__(self):
        self.min_room = {s: pad_multiple(s, self.tp, self.sequence_parallel) // s
                         for s in self.sizes}
        self.fixed = {s: self.cost.run_fixed_seconds(s) for s in self.sizes}

    def padded(self, n: int, size: int) -> int:
        """Length of a sequence of n tokens on a run of `size` ranks, padding included."""
        return padded_length(n, size, self.tp, self.sequence_parallel)


def schedule(lengths: Sequence[int], block_size: int, max_cp: int, capacity_tokens: int,
             cost: DynamicCPCost, static_cp: int | None = None, *, tp: int = 1,
             sequence_parallel: bool = False, raise_cp: bool = True) -> DynamicPlan:
    """Place one step's sequences on a block of `block_size` ranks (module docstring).

    lengths: tokens per sequence (>= 1); max_cp: largest run size, a power of two dividing
    block_size; capacity_tokens: most (padded) tokens one rank holds in one slot; static_cp: the
    classic-CP baseline, every sequence on exactly static_cp ranks; tp, sequence_parallel: the
    tensor-parallel layout (the padding multiple); raise_cp: allow sequences on larger runs than
    they need (steps 2-4).
    """
    lengths = [int(n) for n in lengths]
    _check_layout(block_size, max_cp, capacity_tokens, tp, static_cp)
    prob = _problem(lengths, block_size, static_cp or max_cp, capacity_tokens, tp,
                    sequence_parallel, cost, static_cp, raise_cp and static_cp is None)
    order = _order(prob)
    if not raise_cp or static_cp is not None:
        return _finish(_place(prob, order), prob)
    best = None
    for raise_in_place in (False, True, None):
        slots = _candidate(prob, order, raise_in_place)
        seconds = sum(slot.ceiling for slot in slots)
        if best is None or seconds < (1 - _MIN_GAIN) * best[0]:
            best = seconds, slots
    for slot in best[1]:
        _shrink(slot, prob)
    return _finish(best[1], prob)


def _candidate(prob: _Problem, order: list[int], raise_in_place: bool | None) -> list[Slot]:
    """Steps (2)-(4) with or without raising into existing larger runs; None: the static plan,
    every sequence on top-size runs."""
    if raise_in_place is None:  # exactly schedule(..., static_cp=top): each option list ends
        # with the top size, so its last entry is that problem's only option
        static = dataclasses.replace(prob, options=[o[-1:] for o in prob.options])
        return _place(static, _order(static))
    slots = _place(prob, order, raise_in_place=raise_in_place)
    for k, slot in enumerate(slots):
        _spread_idle(slot, prob)
        slots[k] = _repack(slot, prob, order, raise_in_place)
    return slots


def _check_layout(block_size: int, max_cp: int, capacity: int, tp: int,
                  static_cp: int | None) -> None:
    for name, s in (("max_cp", max_cp), ("static_cp", static_cp)):
        if s is None:
            continue
        if s < 1 or s & (s - 1) or block_size < 1 or block_size % s:
            raise ValueError(f"schedule: {name}={s} must be a power of two that divides the "
                             f"DP x CP block of {block_size} ranks; choose 1, 2, 4, ... <= the "
                             "block's CP size")
    if capacity < 1 or tp < 1:
        raise ValueError(f"schedule: capacity_tokens={capacity} and tp={tp} must be >= 1; set "
                         "parallel.max_tokens_per_rank to the tokens one rank may hold")


def _problem(lengths: list[int], block_size: int, top: int, capacity: int, tp: int, sp: bool,
             cost: DynamicCPCost, static_cp: int | None, raise_cp: bool) -> _Problem:
    """Options per sequence: exactly static_cp; else the smallest fitting size, and with
    raise_cp every larger size up to top as well (a size that fits makes every larger one fit)."""
    sizes = [1 << k for k in range(top.bit_length())]
    n = np.asarray(lengths, dtype=np.int64)
    if n.size and n.min() < 1:
        i = int(np.argmax(n < 1))
        raise ValueError(f"schedule: sequence {i} has length {lengths[i]}; drop empty sequences "
                         "before scheduling")
    usable = [static_cp] if static_cp is not None else sizes
    table = []  # per usable size: (size, fits [N], tokens per rank [N], seconds [N])
    for s in usable:
        pad = pad_to(n, pad_multiple(s, tp, sp))
        table.append((s, pad // s <= capacity, (pad // s).tolist(),
                      cost.seconds(pad.astype(np.float64), s).tolist()))
    if n.size and not table[-1][1].all():
        i = int(np.argmin(table[-1][1]))
        s = usable[-1]
        raise ValueError(
            f"schedule: sequence {i} of {lengths[i]} tokens needs "
            f"{padded_length(lengths[i], s, tp, sp) // s} tokens per rank on {s} ranks, over "
            f"capacity_tokens={capacity}; raise {'static_cp' if static_cp else 'max_cp'} or "
            "parallel.max_tokens_per_rank, or truncate the sequence")
    first = np.zeros(n.size, dtype=np.int64)  # index into table of the smallest fitting size
    for k in range(len(table) - 1, -1, -1):
        first[table[k][1]] = k
    last = len(table) if raise_cp else None
    options = [[(table[k][0], table[k][2][i], table[k][3][i])
                for k in range(f, last or f + 1)] for i, f in enumerate(first.tolist())]
    return _Problem(lengths, options, block_size, sizes, capacity, tp, sp, cost)


def _order(prob: _Problem) -> list[int]:
    """Placement order: densest first (seconds per token held, at the smallest size), ties by
    index. Slots sync, and a full slot costs its tokens times their density, so each slot should
    hold sequences of like density; per-rank cost order would put a 17K-token sequence on 2 ranks
    (8.5K each) behind a 16K one on 1 rank although its attention is denser."""
    return sorted(range(len(prob.lengths)),
                  key=lambda i: (-prob.options[i][0][2] / prob.options[i][0][1], i))


def _place(prob: _Problem, seqs: list[int], floor: int = 1, max_slots: int | None = None,
           raise_in_place: bool = True) -> list[Slot] | None:
    """Step (2): greedy placement of seqs, in that order (module docstring). floor: smallest run
    size a sequence may use; max_slots: return None rather than open more slots;
    raise_in_place: consider existing larger runs."""
    slots: list[Slot] = []
    for i in seqs:
        options = prob.options[i]
        if floor > options[0][0]:
            options = [o for o in options if o[0] >= floor] or options[-1:]
        best = _best_option(slots, options[:1], prob)
        if raise_in_place and len(options) > 1 and (best is None or best[0] > 0):
            raised = _best_option(slots, options[1:], prob)
            if raised is not None and (best is None or raised[:5] < best[:5]):
                best = raised
        size, tokens, seconds = options[0]
        alone = prob.fixed[size] + seconds  # the sequence on a new run of its own
        if best is None or best[0] > alone * (1 + _EPS):  # a new slot is the cheapest place
            if max_slots is not None and len(slots) == max_slots:
                return None
            slots.append(Slot(prob.block_size, prob.sizes))
            best = (alone, size, len(slots) - 1, alone, -1, None, tokens, seconds)
        _, size, m, _, _, run, tokens, seconds = best
        run = run or slots[m].open_run(size, prob.fixed[size])
        slots[m].add(run, i, tokens, seconds)
    return slots


def _repack(slot: Slot, prob: _Problem, order: list[int], raise_in_place: bool) -> Slot:
    """Step (4): the slot's sequences packed again with every run size floor 2, 4, ..., top; the
    fastest packing that fits one slot wins, the smallest floor on ties. Small runs pack coarsely
    (a sequence fills more than half of a run it needs), so a slot of like-density sequences can
    be faster on larger runs, at the price of ring bytes."""
    members = {i for r in slot.runs for i in r.seqs}
    least_work = sum(prob.options[i][0][0] * prob.options[i][0][2] for i in members)
    if least_work / prob.block_size >= (1 - _MIN_GAIN) * slot.ceiling:
        return slot  # balanced already: larger runs never lower a sequence's rank-seconds
    seqs = [i for i in order if i in members]
    best = slot
    for floor in prob.sizes[1:]:
        trial = _place(prob, seqs, floor, max_slots=1, raise_in_place=raise_in_place)
        if trial is None:
            continue
        _spread_idle(trial[0], prob)
        if trial[0].ceiling < best.ceiling and trial[0].ceiling < (1 - _MIN_GAIN) * slot.ceiling:
            best = trial[0]
    return best


def _best_option(slots: list[Slot], options: list[tuple[int, int, float]], prob: _Problem):
    """Cheapest placement among existing slots: (increase of the slot's time, size, slot,
    resulting run cost, first rank (-1: a new run), run or None, tokens per rank, seconds), or
    None; the first five fields order the options. Slots are scanned in order, so the scan stops
    at the first slot that takes the sequence at its first size without raising the step time."""
    best = None
    for m, slot in enumerate(slots):
        for size, tokens, seconds in options:
            if slot.free_top >= size:
                load = prob.fixed[size] + seconds
                key = (_increase(load, slot.ceiling), size, m, load, -1, None, tokens, seconds)
                best = key if best is None or key[:5] < best[:5] else best
            run = None
            if slot.heaps[size] or slot.parked[size]:
                run = slot.lightest(size, tokens, prob.capacity, prob.min_room[size])
            if run is not None:
                load = run.load + seconds
                key = (_increase(load, slot.ceiling), size, m, load, run.first, run, tokens,
                       seconds)
                best = key if best is None or key[:5] < best[:5] else best
        if best is not None and best[0] == 0 and best[1] == options[0][0]:
            return best
    return best


def _increase(load: float, ceiling: float) -> float:
    """How much a run reaching `load` raises its slot's time; float noise of a sum that exactly
    meets the ceiling counts as zero, so equal sequences tie exactly."""
    return max(0.0, load - ceiling) if load > ceiling * (1 + _EPS) else 0.0


def _run_seconds(prob: _Problem, seqs: list[int], size: int) -> tuple[int, float]:
    """(tokens per rank, seconds) of `seqs` packed on a run of `size` ranks."""
    pads = [prob.padded(prob.lengths[i], size) for i in seqs]
    return sum(pads) // size, prob.cost.run_seconds(pads, size)


def _spread_idle(slot: Slot, prob: _Problem) -> None:
    """Step (3): while the slot has free ranks, double the run that sets its time onto free
    ranks (its buddy block, or any free block of twice its size) if that lowers its cost."""
    if slot.free_top == 0 or not slot.runs:
        return
    before = (slot.ceiling, [(r.first, r.size, r.tokens, r.load) for r in slot.runs],
              {s: set(f) for s, f in slot.free.items()})
    while slot.free_top:
        run = max(slot.runs, key=lambda r: (r.load, -r.first))
        if 2 * run.size > slot.top:
            break
        tokens, seconds = _run_seconds(prob, run.seqs, 2 * run.size)
        buddy = run.first ^ run.size
        if seconds >= run.load or tokens > prob.capacity:
            break
        if slot.free_top >= 2 * run.size:
            first = slot.take(2 * run.size)
            slot.give(run.first, run.size)
        elif buddy in slot.free[run.size]:
            slot.free[run.size].remove(buddy)
            slot._refresh_free_top()
            first = min(run.first, buddy)
        else:
            break
        run.first, run.size, run.tokens, run.load = first, 2 * run.size, tokens, seconds
    ceiling = max(r.load for r in slot.runs)
    if ceiling >= before[0]:  # no faster: keep the sequences on their smaller runs
        for r, (first, size, tokens, load) in zip(slot.runs, before[1], strict=True):
            r.first, r.size, r.tokens, r.load = first, size, tokens, load
        slot.free = before[2]
        slot._refresh_free_top()
    slot.ceiling = max(r.load for r in slot.runs)


def _shrink(slot: Slot, prob: _Problem) -> None:
    """Step (5): halve runs below the slot's time: a run's sequences are split (LPT, by cost on
    half the ranks) over its two halves while neither half then exceeds the slot's time or the
    capacity; the step time stays, the ring bytes drop."""
    todo, done = list(slot.runs), []
    while todo:
        run = todo.pop()
        halves = _halve(run, prob, slot.ceiling)
        if halves is None:
            done.append(run)
            continue
        for part in halves:
            if part.seqs:
                todo.append(part)
            else:
                slot.give(part.first, part.size)  # idle ranks
    slot.runs = sorted(done, key=lambda r: r.first)


def _halve(run: OpenRun, prob: _Problem, ceiling: float) -> list[OpenRun] | None:
    """The run's sequences on its two halves (costliest first, each to the lighter half with
    room), or None if a half would be too slow or too full."""
    half = run.size // 2
    if half < 1 or any(prob.options[i][0][0] > half for i in run.seqs):
        return None
    parts = [OpenRun(run.first, half), OpenRun(run.first + half, half)]
    costs = {}
    for i in run.seqs:
        pad = prob.padded(prob.lengths[i], half)
        costs[i] = pad // half, prob.cost.seconds(pad, half)
    for i in sorted(run.seqs, key=lambda i: (-costs[i][1], i)):
        tokens, seconds = costs[i]
        room = [p for p in parts if p.tokens + tokens <= prob.capacity]
        if not room:
            return None
        p = min(room, key=lambda p: (p.load, p.first))
        p.load += seconds + (0.0 if p.seqs else prob.fixed[half])
        p.seqs.append(i)
        p.tokens += tokens
    return parts if max(p.load for p in parts) <= ceiling * (1 + _EPS) else None


def _finish(slots: list[Slot], prob: _Problem) -> DynamicPlan:
    """Frozen runs (idle ranks as empty runs of one), costs recomputed at the final run sizes."""
    rank_cost = np.zeros(prob.block_size)
    out, slot_seconds, cp_bytes, used = [], [], 0.0, {}
    for slot in slots:
        runs, worst = [], 0.0
        for r in slot.runs:
            seqs = tuple(sorted(r.seqs))
            pads = [prob.padded(prob.lengths[i], r.size) for i in seqs]
            seconds = prob.cost.run_seconds(pads, r.size)
            rank_cost[r.first:r.first + r.size] += seconds
            worst = max(worst, seconds)
            cp_bytes += sum(r.size * prob.cost.cp_bytes(n, r.size) for n in pads)
            used[r.size] = used.get(r.size, 0) + len(seqs)
            runs.append(Run(r.size, r.first, seqs))
        runs += [Run(1, f + k, ()) for s, free in slot.free.items() for f in free for k in range(s)]
        out.append(sorted(runs, key=lambda run: run.first_rank))
        slot_seconds.append(worst)
    return DynamicPlan(out, rank_cost, slot_seconds, cp_bytes, dict(sorted(used.items())))
