"""One Dynamic-CP slot while the scheduler (dynamic.py) fills it: its runs, a buddy allocator of
the free aligned rank blocks, and per run size a heap of runs by load, so that the least-loaded
run with room is found without scanning every run."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class OpenRun:
    """A run being filled: tokens and load (seconds) per rank; version tags its heap entries."""

    first: int
    size: int
    seqs: list[int] = field(default_factory=list)
    tokens: int = 0
    load: float = 0.0
    version: int = 0


class Slot:
    """One slot under construction: its runs, a buddy allocator of free aligned rank blocks
    (sizes 1..top), and per run size a heap of (load, first, version, run) entries plus the
    runs parked for want of room (see lightest)."""

    def __init__(self, block_size: int, sizes: list[int]):
        self.sizes, self.top = sizes, sizes[-1]
        self.free: dict[int, set[int]] = {s: set() for s in sizes}
        self.free[self.top] = set(range(0, block_size, self.top))
        self.free_top = self.top  # largest size with a free block, 0 when none
        self.runs: list[OpenRun] = []
        self.heaps: dict[int, list] = {s: [] for s in sizes}
        self.parked: dict[int, list] = {s: [] for s in sizes}  # (-room, first, version, run)
        self.ceiling = 0.0

    def _refresh_free_top(self) -> None:
        self.free_top = max((s for s in self.sizes if self.free[s]), default=0)

    def take(self, size: int) -> int:
        """First rank of a free block of `size`: the lowest of the smallest free size that fits,
        split down (its upper halves stay free)."""
        t = min(s for s in self.sizes if s >= size and self.free[s])
        first = min(self.free[t])
        self.free[t].remove(first)
        while t > size:
            t //= 2
            self.free[t].add(first + t)
        self._refresh_free_top()
        return first

    def give(self, first: int, size: int) -> None:
        """Free a block, merging it with free buddies."""
        while size < self.top and first ^ size in self.free[size]:
            self.free[size].remove(first ^ size)
            first, size = min(first, first ^ size), 2 * size
        self.free[size].add(first)
        self._refresh_free_top()

    def open_run(self, size: int, fixed: float = 0.0) -> OpenRun:
        """A new run on free ranks; its load starts at the run's fixed seconds."""
        run = OpenRun(self.take(size), size, load=fixed)
        self.runs.append(run)
        return run

    def add(self, run: OpenRun, seq: int, tokens: int, seconds: float) -> None:
        run.seqs.append(seq)
        run.tokens += tokens
        run.load += seconds
        run.version += 1
        heapq.heappush(self.heaps[run.size], (run.load, run.first, run.version, run))
        self.ceiling = max(self.ceiling, run.load)

    def lightest(self, size: int, room_needed: int, capacity: int, min_room: int):
        """Least-loaded run of `size` with capacity - tokens >= room_needed, or None.

        Runs without room for the current request are parked, ordered by room, and come back
        when a request fits them: sequences arrive roughly longest first, so requests shrink and
        each run is parked about once (a lookup skipping full runs would make placement O(N^2)).
        Stale entries and runs that no sequence fits any more (room < min_room) are dropped."""
        heap, parked = self.heaps[size], self.parked[size]
        while parked and -parked[0][0] >= room_needed:
            _, _, version, run = heapq.heappop(parked)
            if version == run.version:
                heapq.heappush(heap, (run.load, run.first, run.version, run))
        while heap:
            _, first, version, run = heap[0]
            room = capacity - run.tokens
            if version != run.version or room < min_room:
                heapq.heappop(heap)
            elif room < room_needed:
                heapq.heappop(heap)
                heapq.heappush(parked, (-room, first, version, run))
            else:
                return run
        return None
