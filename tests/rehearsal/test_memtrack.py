"""FastMemTracker (rehearsal/memtrack.py): torch's MemTracker with the per-op peak update over the
active modules only, and several passes of the model in one tracked step (Dynamic-CP's slots, an
RL step's scoring and update), which torch's own tracker refuses."""

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from longctx_moe.rehearsal.memtrack import FastMemTracker


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _passes(tracker, model, sizes):
    with tracker:
        for n in sizes:
            model(torch.randn(n, 64)).sum().backward()
    return tracker.get_tracker_snapshot("peak")


def test_the_same_peak_and_module_snapshots_as_torch_s_tracker():
    ours, theirs = FastMemTracker(), MemTracker()
    got, models = [], [_model(), _model()]  # kept alive: the trackers hold modules weakly
    for t, model in zip((ours, theirs), models, strict=True):
        t.track_external(model)
        got.append(_passes(t, model, [512]))
    assert got[0] == got[1]
    by_name = lambda t: {s.mod_fqn: (dict(s.local_peak), s.snapshots) for s in t.memory_tracking.values()}  # noqa: E731
    assert by_name(ours) == by_name(theirs)


def test_several_passes_of_the_model_in_one_step():
    model = _model()
    tracker = FastMemTracker()
    tracker.track_external(model)
    peak = _passes(tracker, model, [128, 1024, 256])  # torch's own tracker raises on the second
    other = _model()  # `model` stays alive: the tracker holds its modules weakly
    one = FastMemTracker()
    one.track_external(other)
    alone = _passes(one, other, [1024])
    cpu = torch.device("cpu")
    assert peak[cpu]["Total"] >= alone[cpu]["Total"] > 0
    names = [s.mod_fqn for s in tracker.all_stats()]
    assert names.count("pass 1: Sequential") == names.count("pass 2: Sequential") == names.count("Sequential") == 1


def test_a_collective_s_buffers_are_filed_as_communication_buffers():
    from torch.distributed._tools.mem_tracker import _MemRefType

    model = _model()
    tracker = FastMemTracker()
    tracker.track_external(model)
    cpu = torch.device("cpu")
    with tracker:
        recv = torch.empty(1000)  # a receive buffer, made inside the step
        before = dict(tracker.get_tracker_snapshot()[cpu])
        tracker.mark_comm([recv, model[0].weight])  # a parameter stays a parameter
        after = tracker.get_tracker_snapshot()[cpu]
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert moved[_MemRefType.OTH] == 4000 and sum(moved.values()) == 0 and len(moved) == 2


class _ForwardScratch(nn.Module):
    """A forward that makes and drops a large scratch tensor: the step's peak is in the forward."""

    def forward(self, x):
        scratch = torch.zeros(2_000_000)  # 8 MB, more than the backward ever holds
        return x + scratch[:1].sum() * 0


def test_the_backward_s_own_peak_leaves_the_forward_out():
    """Fails if backward_peak records forward moments too (it would equal the step's peak) or
    none (no gradients, which the backward makes)."""
    model = nn.Sequential(_ForwardScratch(), _model())
    tracker = FastMemTracker()
    tracker.track_external(model)
    peak = _passes(tracker, model, [512])
    cpu = torch.device("cpu")
    backward = tracker.backward_peak()[cpu]
    assert 0 < backward["Total"] < peak[cpu]["Total"] - 4_000_000
    grads = sum(v for k, v in backward.items() if str(k).endswith("GRAD"))
    assert grads > 0, backward
