"""The counts of what a GPU step runs (rehearsal/counts.py, bench/gpu_ops.py): each counting rule
on ops whose counts are known, each rule's test shown to fail under a mutation of the rule, and a
small model's whole step pinned exactly, so that a change of the program that adds launches,
copies or syncs fails here (update the pins when a change means to)."""

import json
import subprocess
import sys
from collections import defaultdict
from unittest import mock

import pytest
import torch
from torch import nn

from longctx_moe.rehearsal import collectives, standins
from longctx_moe.rehearsal import counts as C
from tests.launcher import run_script
from tests.rehearsal.helpers import ROOT


def _count(fn) -> dict:
    with C.OpCounts() as c:
        fn()
    return c.report()


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


# ---- each rule, and its mutation


def _layout_launches() -> int:
    from longctx_moe.kernels import triton_ops

    idx = torch.zeros(16, 2, dtype=torch.int64, device="meta")
    return _count(lambda: triton_ops().route_layout(idx, 4))["launches_per_step"]


def test_an_operator_of_several_kernels_counts_each():
    """The route layout's operator runs three kernels (kernels.LAUNCHES_PER_CALL); a mutation
    that counts each call once fails."""
    assert _layout_launches() == 3
    with mock.patch.dict("longctx_moe.kernels.LAUNCHES_PER_CALL", clear=True):
        assert _layout_launches() == 1


def _view_launches() -> int:
    x = _meta(4, 8)
    return _count(lambda: (x.view(8, 4), x.t(), x[1:], x.unsqueeze(0), x.reshape(32)))["launches_per_step"]


def test_views_launch_nothing_and_kernels_launch_once():
    x = _meta(4, 8)
    assert _view_launches() == 0
    assert _count(lambda: (x + 1, x.sum(), x @ x.t()))["launches_per_step"] == 3
    # a fill and an arange write the device from nothing; a bare allocation does not launch
    made = lambda: (torch.zeros(4, device="meta"), torch.arange(4, device="meta"), torch.empty(4, device="meta"))  # noqa: E731
    assert _count(made)["launches_per_step"] == 2


def test_view_rule_mutation_is_caught():
    # mutation: a view counted as a launch (the rule DeviceRules' count shares)
    with mock.patch.object(collectives, "_VIEWS", defaultdict(bool)):
        assert _view_launches() != 0


def _copy_bytes() -> int:
    x, y = _meta(4, 8), _meta(4, 8, dtype=torch.bfloat16)
    # a cast (128 read + 64 written), copy_ (64 read + 128 written), cat (2 x 128 + 256), add (none)
    return _count(lambda: (x.to(torch.bfloat16), x.copy_(y), torch.cat([x, x]), x + x))["copy_bytes_per_step"]


def test_copy_bytes_count_reads_and_writes_of_copies_only():
    assert _copy_bytes() == (128 + 64) + (64 + 128) + (2 * 128 + 256)


def test_copy_rule_mutation_is_caught():
    with mock.patch.object(C, "COPY_OPS", frozenset({"_to_copy"})):  # mutation: copy_ and cat not copies
        assert _copy_bytes() != (128 + 64) + (64 + 128) + (2 * 128 + 256)


def _syncs() -> dict:
    x = _meta(16)
    host = torch.zeros(16)

    def step():
        x.nonzero()  # sized by device values
        x.sum().item()  # a device value read on the host
        host.to("meta")  # a blocking host-to-device copy
        host.to("meta", non_blocking=True)  # none
        x + 1  # none

    with standins.standins(), C.OpCounts() as c:
        standins.on_read.append(c.sync)
        try:
            step()
        finally:
            standins.on_read.remove(c.sync)
    return c.report()


def test_host_syncs_are_counted_where_the_host_waits():
    r = _syncs()
    assert r["host_syncs_per_step"] == 3, r["host_syncs"]
    assert r["h2d_copies_per_step"] == 2
    assert r["by_op"]["aten._to_copy (h2d)"]["launches"] == 0  # a memcpy, not a kernel


def test_sync_rule_mutations_are_caught():
    with mock.patch.object(C, "SYNC_OPS", frozenset()):  # mutation: nonzero not a sync
        assert _syncs()["host_syncs_per_step"] != 3
    with mock.patch.object(C.OpCounts, "_host_copy", lambda *a, **k: None):  # mutation: no h2d copies
        assert _syncs()["host_syncs_per_step"] != 3


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU()) for _ in range(2))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x * 2


def _by_module() -> dict:
    model = _Tiny().to("meta")
    x = _meta(4, 8)
    return _count(lambda: model(x))


def test_ops_are_filed_under_the_innermost_module_and_layer():
    r = _by_module()
    mods = {m: v["launches"] for m, v in r["by_module"].items()}
    assert mods == {"embed": 1, "layers.0.0": 1, "layers.0.1": 1, "layers.1.0": 1, "layers.1.1": 1, "model": 1}
    assert [row["launches"] for row in r["layers"]] == [2, 2]


def test_module_rule_mutation_is_caught():
    # mutation: the outermost module instead of the innermost
    with mock.patch.object(C.OpCounts, "module", lambda self: "model"):
        assert _by_module()["layers"] == []


# Two fake worlds, one after the other in one process of their own (each rehearse_rank and count_step builds
# and tears down its own): rank 0 of one rehearsed with its optimizer recorded, then the EP2
# step's routing-count syncs as it is and under the mutation (the routing seam's reads not
# counted). Each part's answer or traceback is kept apart (the last line, JSON).
_FAKE_WORLDS = """
import json, sys, traceback
from bench.gpu_ops import bench_config
from longctx_moe.rehearsal import counts, step
from longctx_moe.rehearsal.gpus import GPUS

def rehearsed_fused():
    fused, measure = [], step.measure_step
    def seen(fn, trainer, *args):
        inner = trainer.optimizer
        while not hasattr(inner, "defaults"):
            inner = inner.optimizer
        fused.append(inner.defaults["fused"])
        return measure(fn, trainer, *args)
    step.measure_step = seen
    try:
        cfg, lengths = bench_config(sys.argv[1:], 1024)
        step.rehearse_rank(cfg, 1, 0, GPUS["h200"], lengths)
    finally:
        step.measure_step = measure
    return fused

def ep2_layer_syncs():
    cfg, lengths = bench_config([*sys.argv[1:], "parallel.ep=2"], 2048)
    syncs = {}
    for mode in ("as_is", "mutated"):
        if mode == "mutated":
            counts._routing_seams = lambda runtime: []
        r = counts.count_step(cfg, lengths, world=2, rank=0)
        syncs[mode] = [row["host_syncs"] for row in r["layers"]]
    return syncs

out = {}
for name, part in (("fused", rehearsed_fused), ("ep2_syncs", ep2_layer_syncs)):
    try:
        out[name] = {"value": part()}
    except Exception:
        out[name] = {"error": traceback.format_exc()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fake_worlds() -> dict[str, dict]:
    """Each part of _FAKE_WORLDS' answer (one process for both tests, forked from the preloaded
    server: a fresh interpreter's imports were most of their time)."""
    done = run_script(_FAKE_WORLDS, *TINY, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _value(fake_worlds: dict, part: str):
    assert "error" not in fake_worlds[part], fake_worlds[part]["error"]
    return fake_worlds[part]["value"]


@pytest.mark.slow  # a process of fake worlds
def test_routing_counts_read_is_one_sync_per_layer_under_ep(fake_worlds):
    """With EP the dispatcher reads the routing counts once per MoE layer forward (RoutingCounts,
    the program's one routing seam): filed under its layer; a mutation that drops the count fails."""
    syncs = _value(fake_worlds, "ep2_syncs")
    assert syncs["as_is"] == [1, 1]
    assert syncs["mutated"] == [0, 0]


# ---- a small model's step, pinned

TINY = ["model.num_layers=2", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=64", "model.num_experts=8", "model.top_k=2", "model.expert_hidden_size=128",
        "model.vocab_size=4096"]


@pytest.fixture(scope="module")
def tiny_step(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_ops") / "r.json"
    cmd = [sys.executable, "bench/gpu_ops.py", "--tokens", "2048", "--out", str(out)]
    cmd += [a for s in TINY for a in ("--set", s)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_small_model_step_counts_are_pinned(tiny_step):
    r = tiny_step
    assert (r["launches_per_step"], r["copy_bytes_per_step"], r["host_syncs_per_step"]) == PINNED, \
        "the step's counts changed: read bench/gpu_ops.py's tables and update PINNED if meant"
    layers = [row["launches"] for row in r["layers"]]
    assert len(layers) == 2 and sum(layers) == PINNED_LAYERS_SUM, layers
    assert "launches_ratio" not in r  # the baseline is the bench model's, not this one's


def test_small_model_step_runs_the_gpus_fused_adamw(tiny_step):
    """count_step builds the optimizer where meta counts as CUDA: AdamW is one fused kernel and
    one step-count increment per parameter group (two: decayed and not), as on a GPU, not the
    foreach path's dozen launches."""
    ops = {op: row["launches"] for op, row in tiny_step["by_op"].items()}
    assert ops["aten._fused_adamw_"] == 2 and ops["aten._foreach_add_"] == 2, ops
    assert not {"aten._foreach_lerp_", "aten._foreach_addcdiv_", "aten._foreach_sqrt"} & ops.keys(), ops


PINNED = (257, 54699070, 3)
# The module tracker files a few backward ops at a layer boundary under one layer or the next,
# not always the same one from run to run: the layers' sum is pinned.
PINNED_LAYERS_SUM = 162


# ---- the reductions, on the ops a CUDA device runs


def _varlen_backward_counts():
    from cp_attention.kernels import torch_varlen

    t, hq, hkv, d = 64, 8, 2, 32
    q, dout, out = (_meta(t, hq, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = _meta(t, hkv, d, dtype=torch.bfloat16), _meta(t, hkv, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, 40, 64], dtype=torch.int32, device="meta")
    with C.OpCounts() as c:
        dq, dk, dv = torch_varlen.backward(dout, q, k, v, out, _meta(hq, t), cu, cu, 40, 40, True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    return c.report()


def test_gqa_attention_backward_takes_kv_heads_as_they_are():
    """torch's varlen flash backward gets k / v at their own head count (no copy to the query
    heads' count); without torch's GQA flag it copies them, as before."""
    from cp_attention.kernels import torch_varlen

    assert _varlen_backward_counts()["copy_bytes_per_step"] == 0
    older = mock.MagicMock()
    older.varlen_attn = lambda q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None: None
    with mock.patch.object(torch_varlen, "_varlen_module", lambda: older):
        assert _varlen_backward_counts()["by_op"]["aten.clone"]["launches"] == 2


def _attention_launches_per_layer() -> list[int]:
    """Launches of torch's varlen attention, forward and backward, in each of two layers that
    share one micro-batch's device bounds (as DocLayout.cu_attn_S is shared), on meta as CUDA."""
    from cp_attention.kernels import torch_varlen
    from longctx_moe.rehearsal.gpus import GPUS, as_cuda_device
    from longctx_moe.rehearsal.meta_device import cuda_kernels

    t, hq, hkv, d = 64, 8, 2, 32
    cu = torch.tensor([0, 40, 64], dtype=torch.int32, device="meta")
    per_layer = []
    with as_cuda_device(GPUS["h200"]), cuda_kernels():
        for _ in range(2):
            q, k, v, dout = (_meta(t, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
            with C.OpCounts() as c:
                out, lse = torch_varlen.forward(q, k, v, cu, cu, 40, 40, True)
                torch_varlen.backward(dout, q, k, v, out, lse, cu, cu, 40, 40, True)
            per_layer.append(c.report()["launches_per_step"])
    return per_layer


def test_attention_padding_bookkeeping_is_made_once_per_micro_batch():
    """A layer's attention launches its two kernels and eight fix-ups (the lse's +inf and the
    trailing padding, forward and backward); the trailing-padding mask (arange, compare) is made
    by the first layer only. A mutation that makes it at each use (the forward's rows, dq's,
    dk's and dv's) fails."""
    from cp_attention.kernels import flash_attn

    assert _attention_launches_per_layer() == [12, 10]

    class Forgetful(dict):
        def setdefault(self, key, default=None):
            return {}

    with mock.patch.object(flash_attn, "_TAILS", Forgetful()):
        assert _attention_launches_per_layer() == [16, 16]


# ---- the optimizer a CUDA GPU runs, and one launch rule for both counts


def _adamw_launches() -> tuple[bool, int]:
    """(fused?, launches of a steady-state step) of an AdamW built and stepped on meta as the
    rehearsal does, within meta_device.cuda_kernels()."""
    from longctx_moe.config import OptimConfig
    from longctx_moe.optim import build_adamw
    from longctx_moe.rehearsal.meta_device import cuda_kernels

    params = [nn.Parameter(_meta(8, 8)), nn.Parameter(_meta(8, 8)), nn.Parameter(_meta(8))]
    with cuda_kernels():
        opt = build_adamw(params, OptimConfig())
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step()  # creates the state
        return opt.defaults["fused"] is True, _count(opt.step)["launches_per_step"]


def test_rehearsed_adamw_is_fused_as_on_a_gpu():
    """optim.impl=auto on CUDA is fused AdamW: per parameter group, the step-count increment and
    the one kernel. A mutation that lists meta for the foreach kernels only (the rehearsal's
    AdamW then foreach) fails."""
    from longctx_moe.rehearsal import meta_device

    assert _adamw_launches() == (True, 4)
    with mock.patch.object(meta_device, "_LISTS", ("_get_foreach_kernels_supported_devices",)):
        fused, launches = _adamw_launches()
    assert not fused and launches > 4


def _both_counts(fn) -> tuple[int, int]:
    """(DeviceRules' launches, OpCounts' launches) of `fn()` under both modes at once."""
    rules = collectives.DeviceRules(rank=0)
    with rules, C.OpCounts() as c:
        fn()
    return sum(rules.launches.values()), c.report()["launches_per_step"]


def _small_step() -> None:
    """A forward, backward and fused AdamW step of a tiny model on meta, the route layout (three
    kernels a call), a fill, views and a host-to-device copy."""
    from longctx_moe.config import OptimConfig
    from longctx_moe.kernels import triton_ops
    from longctx_moe.optim import build_adamw
    from longctx_moe.rehearsal.meta_device import cuda_kernels

    model = _Tiny().to("meta")
    with cuda_kernels():
        opt = build_adamw(list(model.parameters()), OptimConfig())
        model(_meta(4, 8)).sum().backward()
        opt.step()
    triton_ops().route_layout(torch.zeros(16, 2, dtype=torch.int64, device="meta"), 4)
    torch.zeros(4, device="meta").view(2, 2).t()
    torch.arange(4).to("meta")


def test_device_rules_and_op_counts_agree_on_launches():
    """DeviceRules (the modeled step time's launches) and OpCounts (bench/gpu_ops.py) count one
    rule, collectives.launches_of; a mutation that counts an operator of several kernels once in
    DeviceRules only fails."""
    rules_n, counts_n = _both_counts(_small_step)
    assert rules_n == counts_n and counts_n > 3, (rules_n, counts_n)
    launches_of = collectives.launches_of
    once = lambda *a: min(1, launches_of(*a))  # noqa: E731
    with mock.patch.object(collectives, "launches_of", once):
        rules_n, counts_n = _both_counts(_small_step)
    assert rules_n == counts_n - 2  # the route layout's two further kernels


@pytest.mark.slow  # a process of fake worlds
def test_rehearse_rank_builds_the_gpus_fused_adamw(fake_worlds):
    assert _value(fake_worlds, "fused") == [True]
