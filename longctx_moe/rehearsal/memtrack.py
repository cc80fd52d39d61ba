"""torch's MemTracker, with its per-op peak update made proportional to the modules active now.

`MemTracker._update_peak_stats` runs after every op and walks every module it has ever tracked
to find the ones in the current forward / backward (`_mod_tracker.parents`), each step through a
weak reference (an `nn.Module.__getattr__` per module). On a full-size model that is thousands of
modules times tens of thousands of ops: most of a rehearsal's time. Here the walk goes over the
active modules only, found by name; what it records is the same.
"""

from __future__ import annotations

from copy import deepcopy

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker


class FastMemTracker(MemTracker):
    def __init__(self) -> None:
        super().__init__()
        self._stats_by_fqn: dict = {}
        self._stats_seen = None

    def _active_stats(self):
        seen = (id(self.memory_tracking), len(self.memory_tracking))
        if seen != self._stats_seen:  # a module tracked for the first time, or the table reset
            self._stats_by_fqn = {s.mod_fqn: s for s in self.memory_tracking.values()}
            self._stats_seen = seen
        return [s for fqn in self._mod_tracker.parents if (s := self._stats_by_fqn.get(fqn)) is not None]

    def _update_peak_stats(self, peak_state) -> None:
        curr_snap = self._curr_mem_snap
        for mod_stats in self._active_stats():
            if peak_state in mod_stats.snapshots:
                for dev, dev_snap in curr_snap.items():
                    if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        mod_stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)
