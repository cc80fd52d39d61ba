"""What a rehearsal answers when the program reads a device value on the host, and the count of
those reads (each one a device-to-host sync on a GPU).

Routing counts come through the program's own seam (routing.py). Anything else the program
reads back from a device tensor (`.item()`, `.tolist()`, `.cpu()`, `bool()` / `int()` /
`float()`, and the size of a `nonzero`) has no value on meta: within `standins()` it is answered
with zeros (a `nonzero` as if every element were nonzero: every label a target) and counted by
the program's file:line in `host_reads`, the step's host syncs.

    with standins():
        trainer.train_step(batches)
    host_reads  # Counter {("trainer.py:369 (_to_host)", "cpu"): 1, ...}
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from longctx_moe.rehearsal.collectives import program_line

host_reads: collections.Counter = collections.Counter()
# called with (what, "file:line (function)") at each read, beside the count (counts.py files it by module)
on_read: list = []


@contextlib.contextmanager
def standins() -> Iterator[None]:
    import torch.fx.experimental._config as fx_config

    with contextlib.ExitStack() as stack:
        for name in ("cpu", "tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, _host_read(getattr(torch.Tensor, name), name)))
        stack.enter_context(mock.patch.object(fx_config, "meta_nonzero_assume_all_nonzero", True))
        yield


def _host_read(orig, name):
    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # noqa: E731
    make = {"cpu": lambda t, *a, **k: zeros(t), "tolist": lambda t: zeros(t).tolist(),
            "item": lambda t: zeros(t).item(), "__bool__": lambda t: False, "__int__": lambda t: 0,
            "__float__": lambda t: 0.0, "__index__": lambda t: 0}[name]

    def read(self, *args, **kwargs):
        if not self.is_meta:
            return orig(self, *args, **kwargs)
        line = program_line()
        host_reads[(line, name)] += 1
        for listener in on_read:
            listener(name, line)
        return make(self, *args, **kwargs)
    return read
