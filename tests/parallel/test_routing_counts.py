"""Routing counts reach the host through one seam (comm.RoutingCounts), at most once per MoE
layer and forward, and nowhere else.

- The seam itself: the table it reads holds every rank's kept assignments per expert and token
  count; a substituted reader is what the dispatcher sizes its work by; a dispatcher with
  nothing to size (one rank, dropless) reads nothing, one that has reads once per forward and
  never in the backward.
- On `meta` tensors (no storage: any .item(), .tolist(), bool(), .cpu() or nonzero of one raises,
  and on a GPU each would be a sync) an MoE layer runs forward and backward, balance losses,
  padding and router replay included, with the seam fed from an assumption (every rank routes
  like this one, evenly over the experts): one rank in this process; EP, ETP, lending, capacity
  and the all-gather dispatcher on 4 ranks of torch's fake process group in a process of its own.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from cp_attention.kernels import AttnKernel
from longctx_moe.execution import Ops
from longctx_moe.model.attention import doc_layout
from longctx_moe.model.config import BalanceConfig
from longctx_moe.model.moe import LocalDispatcher, MoE
from longctx_moe.parallel.comm import RouteTable, RoutingCounts, gather_route_table
from longctx_moe.parallel.dispatch import AllGatherDispatcher, AllToAllDispatcher, route
from tests.launcher import run_script
from tests.model.helpers import packed_batch, tiny_config

ROOT = Path(__file__).resolve().parents[2]
E, K = 8, 2


class BalancedCounts(RoutingCounts):
    """An assumption in place of the device: every rank of the table routes as this rank does,
    its T*K assignments spread evenly over the E experts (at most `capacity` each). Records what
    it was asked."""

    def __init__(self):
        self.reads: list[tuple[tuple[int, ...], RouteTable]] = []

    def read(self, table: torch.Tensor, spec: RouteTable) -> torch.Tensor:
        self.reads.append((tuple(table.shape), spec))
        n, e = spec.tokens * spec.top_k, spec.num_experts
        row = torch.full((e,), n // e, dtype=torch.int64)
        row[: n % e] += 1
        if spec.capacity is not None:
            row = row.clamp(max=spec.capacity)
        return torch.cat([row, torch.tensor([spec.tokens])]).expand(table.shape).clone()


class _Recording(RoutingCounts):
    """The device reader, recording each table it read."""

    def __init__(self):
        self.tables: list[torch.Tensor] = []

    def read(self, table, spec):
        self.tables.append(super().read(table, spec))
        return self.tables[-1]


def _cfg():
    return tiny_config(num_experts=E, top_k=K, hidden_size=32, expert_hidden_size=16, first_k_dense=0)


# ---------------------------------------------------------------------- the seam, on the host


def test_the_table_is_each_ranks_kept_counts_and_tokens_and_read_back_once():
    idx = torch.tensor([[0, 1], [1, 2], [1, 0], [7, 1]])
    got = route(idx, torch.rand(4, 2), E, capacity_factor=1.0, drop_policy="position",
                counts=(rec := _Recording()))
    # capacity ceil(1.0 * 4 * 2 / 8) = 1 per expert: one of expert 0's two and of 1's four kept
    assert len(rec.tables) == 1 and rec.tables[0].device.type == "cpu"
    assert rec.tables[0].tolist() == [[[1, 1, 1, 0, 0, 0, 0, 1, 4]]]
    assert got.expert_N.tolist() == [0, 1, 2, 7] and got.token_N.tolist() == [0, 0, 1, 3]
    row = torch.tensor([3, 0, 5, 4])
    assert torch.equal(gather_route_table(row), row.view(1, 1, 4))  # no group: [1, 1, E + 1]


@pytest.mark.parametrize("make", [
    lambda c: AllToAllDispatcher(E, counts=c),
    lambda c: AllToAllDispatcher(E, capacity_factor=1.5, counts=c),
    lambda c: AllGatherDispatcher(E, capacity_factor=1.5, counts=c),
])
def test_a_forward_reads_the_counts_at_most_once_and_the_backward_never(make):
    moe = MoE(_cfg(), balance=BalanceConfig(aux_loss_type="seq", z_loss_coeff=1e-3)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.dispatcher = make(rec := _Recording())
    layout = doc_layout(packed_batch([5, 3, 7], 64, pad_multiple=4, trailing_pad=3))
    x = torch.randn(layout.doc_id_T.numel(), 32, dtype=torch.float64, requires_grad=True)
    y, stats = moe(x, layout)
    reads = len(rec.tables)
    assert reads == (0 if moe.dispatcher.capacity_factor is None else 1)  # one rank, dropless: none
    (y.square().sum() + stats.aux_loss + stats.z_loss).backward()
    assert len(rec.tables) == reads and x.grad is not None


# ---------------------------------------------------------------------- on meta: nothing read back


@contextlib.contextmanager
def _meta_autocast_off():
    """torch has no autocast for meta (`torch.autocast("meta")` raises): the router's float32
    region becomes a no-op there for the block (a rehearsal applies CUDA's rules instead)."""
    real = torch.autocast

    def autocast(device_type, *args, **kwargs):
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *args, **kwargs)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = real


META_OPS = Ops(attention=AttnKernel("torch_varlen"), grouped_gemm="grouped_mm", device="cuda")


def _meta_moe(aux: str) -> MoE:
    with torch.device("meta"):
        return MoE(_cfg(), META_OPS, BalanceConfig(aux_loss_type=aux, z_loss_coeff=1e-3)).to(torch.bfloat16)


def _meta_step(moe: MoE, replay: bool, dim: int = 32) -> tuple:
    layout = doc_layout(packed_batch([5, 3, 7], 64, pad_multiple=4, trailing_pad=4).to("meta"))  # T = 24
    T = layout.doc_id_T.shape[0]
    x = torch.empty(T, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
    replay_TK = torch.empty(T, K, device="meta", dtype=torch.int64) if replay else None
    with _meta_autocast_off():
        y, stats = moe(x, layout, replay_TK)
        (y.float().sum() + stats.aux_loss + stats.z_loss).backward()
    return x, y, stats


@pytest.mark.parametrize("dispatcher", ["local", "alltoall_capacity", "allgather_capacity"])
@pytest.mark.parametrize("aux,replay", [("seq", True), ("switch", False)])
def test_an_moe_layer_runs_on_meta_with_the_counts_from_an_assumption(dispatcher, aux, replay):
    moe = _meta_moe(aux)
    counts = BalancedCounts()
    if dispatcher != "local":
        cls = AllToAllDispatcher if dispatcher.startswith("alltoall") else AllGatherDispatcher
        moe.dispatcher = cls(E, capacity_factor=1.25, counts=counts)
    x, y, stats = _meta_step(moe, replay)
    assert y.is_meta and y.shape == x.shape and x.grad.is_meta
    assert moe.experts.w_down.grad.is_meta and moe.router.weight.grad.is_meta
    assert stats.counts_E.is_meta and stats.counts_E.shape == (E,)
    assert stats.aux_loss.is_meta and stats.z_loss.is_meta
    assert (torch.is_tensor(stats.replay_known) and stats.replay_known.is_meta) == replay
    # one rank reads counts only to size the capacity's kept rows: once, for 24 tokens
    assert [s.tokens for _, s in counts.reads] == ([] if dispatcher == "local" else [24])


# Rank 1 of torch's fake process group of 4, in a process of its own (one default process group
# per process); each block below runs there in turn, in its own namespace, its printed lines or
# its traceback kept apart (argv[1]: the blocks as a JSON list; the answer is the last line).
_FAKE_WORLD_RUNNER = """
import contextlib, io, json, sys, traceback
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
out = []
for code in json.loads(sys.argv[1]):
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(code, {})
        out.append({"lines": printed.getvalue().strip().splitlines()})
    except Exception:
        out.append({"error": traceback.format_exc()})
print(json.dumps(out))
"""

_FAKE_WORLD = """
import torch, torch.distributed as dist
from longctx_moe.model.transformer import Transformer
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from tests.parallel.test_routing_counts import BalancedCounts, META_OPS, _cfg, _meta_step
from longctx_moe.model.config import BalanceConfig

layouts = [dict(ep=4), dict(ep=4, dispatcher="allgather"), dict(ep=2, etp=2),
           dict(ep=4, ep_spare_slots=1), dict(ep=4, capacity_factor=1.25, moe_overlap=True),
           dict(ep=2, etp=2, dispatcher="allgather", capacity_factor=1.25)]
for kw in layouts:
    cfg = ParallelConfig(**kw)
    dims = ParallelDims.from_config(cfg, 4)
    dims.build_groups(1)
    with torch.device("meta"):
        model = Transformer(_cfg(), META_OPS, BalanceConfig(aux_loss_type="seq", z_loss_coeff=1e-3))
    counts = BalancedCounts()
    parallelize(model.to(torch.bfloat16), dims, cfg, counts=counts)
    moe = model.layers[0].ffn
    x, y, stats = _meta_step(moe, replay=True)
    assert y.is_meta and x.grad.is_meta and moe.experts.w_down.grad.is_meta, kw
    shapes = [shape for shape, _ in counts.reads]
    print(kw, moe.dispatcher.wire_bytes, shapes)
"""


@pytest.fixture(scope="module")
def fake_world_printed() -> dict[str, dict]:
    """Each fake-world block's printed lines (or traceback), from one process forked from
    the preloaded server (a fresh interpreter's imports were most of each test's time)."""
    import json

    blocks = {"layers": _FAKE_WORLD, "fp8 layers": _FAKE_WORLD_FP8}
    done = run_script(_FAKE_WORLD_RUNNER, json.dumps(list(blocks.values())), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(blocks, json.loads(done.stdout.strip().splitlines()[-1]), strict=True))


def _printed_lines(printed: dict, block: str) -> list[str]:
    assert "error" not in printed[block], printed[block]["error"]
    return printed[block]["lines"]


@pytest.mark.slow
def test_ep_etp_lending_and_allgather_layers_run_on_meta_under_a_fake_world(fake_world_printed):
    lines = _printed_lines(fake_world_printed, "layers")
    reads = [line.split(" [", 1)[1] for line in lines]
    # One read per forward: the table of the EP group ([1, 4, E + 1]), or of both groups under ETP.
    assert reads == ["(1, 4, 9)]", "(1, 4, 9)]", "(2, 2, 9)]", "(1, 4, 9)]", "(1, 4, 9)]", "(2, 2, 9)]"]
    # The assumption sizes the all-to-all: 24 tokens x 2 = 48 assignments, 6 per expert, 12 to
    # each rank's 2 experts and 12 from each: 36 rows out and 36 back, of 32 bf16 features.
    assert lines[0].split(" [")[0].endswith("} 4608")


# ---------------------------------------------------------------------- FP8 experts


@pytest.mark.parametrize("dispatcher", ["local", "alltoall_capacity"])
def test_fp8_experts_loop_by_the_counts_of_the_seam_read_once_per_layer_forward(dispatcher):
    """The FP8 GEMMs loop over experts by host counts: the dispatcher hands down the ones it read
    through the routing seam (the single-device one reads them there for its FP8 experts), once
    per layer forward, and no expert GEMM reads the device's (on meta any read back raises; on a
    GPU each is a sync). On the host the layer learns from the counts it was handed."""
    def make(counts):
        if dispatcher == "local":
            return LocalDispatcher("torch", counts)
        return AllToAllDispatcher(E, capacity_factor=1.5, counts=counts)

    with torch.device("meta"):
        meta = MoE(_cfg(), META_OPS.replace(fp8="torch")).to(torch.bfloat16)
    meta.dispatcher = make(counts := BalancedCounts())
    x, y, _ = _meta_step(meta, replay=False)
    assert y.is_meta and meta.experts.w_down.grad.is_meta and len(counts.reads) == 1
    moe = MoE(_cfg(), Ops(fp8="torch"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.dispatcher = make(rec := _Recording())
    layout = doc_layout(packed_batch([5, 3, 7], 64, pad_multiple=4, trailing_pad=3))
    x = torch.randn(layout.doc_id_T.numel(), 32, requires_grad=True)
    y, _ = moe(x, layout)
    y.square().sum().backward()
    assert len(rec.tables) == 1 and x.grad is not None and moe.experts.w_down.grad.abs().sum() > 0


# FP8 layers of EP, ETP, lending and both dispatchers under the fake group, on meta: the experts
# loop by the counts the dispatcher read through the seam, never by a read of their own.
_FAKE_WORLD_FP8 = """
import torch, torch.distributed as dist
from longctx_moe.kernels import fp8_grouped
from longctx_moe.model.transformer import Transformer
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from tests.model.helpers import tiny_config
from tests.parallel.test_routing_counts import BalancedCounts, META_OPS, _meta_step

grouped, real = [], fp8_grouped.call
fp8_grouped.call = lambda *a: grouped.append(1) or real(*a)
cfg = tiny_config(num_experts=8, top_k=2, hidden_size=128, expert_hidden_size=256, num_heads=4, num_kv_heads=4,
                  head_dim=32, first_k_dense=0)
tensor = META_OPS.replace(fp8="torch", fp8_grouped=True)  # as resolved for a Hopper
block = META_OPS.replace(fp8="torch", fp8_recipe="block")
runs = [(tensor, dict(ep=4)), (tensor, dict(ep=4, dispatcher="allgather")), (tensor, dict(ep=2, etp=2)),
        (tensor, dict(ep=4, ep_spare_slots=1)), (block, dict(ep=4, dispatch_dtype="fp8", moe_overlap=True)),
        (block, dict(ep=2, etp=2, dispatcher="allgather", capacity_factor=1.25))]
for ops, kw in runs:
    cfg_p = ParallelConfig(**kw)
    dims = ParallelDims.from_config(cfg_p, 4)
    dims.build_groups(1)
    with torch.device("meta"):
        model = Transformer(cfg, ops)
    counts, grouped[:] = BalancedCounts(), []
    parallelize(model.to(torch.bfloat16), dims, cfg_p, counts=counts)
    moe = model.layers[0].ffn
    x, y, stats = _meta_step(moe, replay=False, dim=128)
    assert y.is_meta and x.grad.is_meta and moe.experts.w_down.grad.is_meta, kw
    print(ops.fp8_recipe, kw, len(counts.reads), len(grouped))
"""


@pytest.mark.slow
def test_fp8_ep_etp_lending_and_allgather_layers_run_on_meta_reading_only_the_seam(fake_world_printed):
    lines = _printed_lines(fake_world_printed, "fp8 layers")
    # one read of the seam per forward; the per-tensor recipe's two forward GEMMs are one grouped
    # call each (resolved for a Hopper), the block recipe loops
    assert [line.rsplit(" ", 2)[1:] for line in lines] == [["1", "2"]] * 4 + [["1", "0"]] * 2, lines
