"""The rehearsal refuses what NCCL and a CUDA kernel would refuse, which torch's fake process
group lets through: each planted fault fails in one line naming the rank, the op and the
program's line; and it counts the bytes each group moves. The tests' code runs in one process of
its own (one default process group per process), each test's block with its own DeviceRules."""

import json
from pathlib import Path

import pytest

from tests.launcher import run_script

ROOT = Path(__file__).resolve().parents[2]

_SETUP = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from longctx_moe.rehearsal.collectives import DeviceRules, RehearsalFault
from longctx_moe.parallel.comm import host_collective
dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
ep = dist.new_group([4, 5, 6, 7])
def caught(step):
    try:
        with rules:
            step()
    except RehearsalFault as e:
        return str(e)
    return "not caught"
meta = lambda *s, dtype=torch.float32: torch.empty(*s, device="meta", dtype=dtype)
"""
# Each block in turn, with fresh rules (`rules`, which `caught` uses) and its printed lines, or
# its traceback, kept apart: the blocks come as a JSON list in argv[1], the answer is the last line.
_BLOCKS = """
import contextlib, io, sys, traceback
out = []
for code in json.loads(sys.argv[1]):
    rules = DeviceRules(rank=5, group_names={ep.group_name: "ep"})
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(code)
        out.append({"lines": printed.getvalue().strip().splitlines()})
    except Exception:
        out.append({"error": traceback.format_exc()})
print(json.dumps(out))
"""

_PLANTED = """
print(caught(lambda: dist.all_reduce(torch.ones(3), group=ep)))
print(caught(lambda: meta(4, 3) + torch.ones(4, 3)))
print(caught(lambda: dist.all_gather_into_tensor(meta(12), meta(4), group=ep)))
"""
_DISAGREE = """
from longctx_moe.rehearsal.collectives import check_agreement
a2a = lambda dtype: dist.all_to_all_single(meta(8, 2, dtype=dtype), meta(8, 2, dtype=dtype), group=ep)
logs = {}
for rank, dtype in ((4, torch.float32), (5, torch.bfloat16)):
    r = DeviceRules(rank=rank, group_names={ep.group_name: "ep[4-7]"})
    with r:
        a2a(torch.float32)
        a2a(dtype)
    logs[rank] = dict(r.calls)
for case in (logs, {4: logs[4], 5: {"ep[4-7]": logs[4]["ep[4-7]"][:1]}}, {4: logs[4], 6: logs[4]}):
    try:
        check_agreement(case)
        print("agree")
    except RehearsalFault as e:
        print(e)
"""
_ACCEPTED = """
@host_collective
def totals():
    dist.all_reduce(torch.ones(2, dtype=torch.float64))  # by design, on gloo
print(caught(lambda: (dist.all_gather_into_tensor(meta(16), meta(4), group=ep), totals(),
                      meta(3) * torch.tensor(2.0), dist.all_reduce(meta(10), group=ep))))
for (group, kind), t in sorted(rules.traffic.items()):
    print(group, kind, t.calls, t.payload_bytes, t.bus_bytes)
print(sum(rules.host_collectives.values()))
"""


@pytest.fixture(scope="module")
def printed() -> dict[str, dict]:
    """Each block's printed lines (or traceback), from one process forked from the
    preloaded server (a fresh interpreter's imports were most of each test's time)."""
    blocks = {"planted": _PLANTED, "disagree": _DISAGREE, "accepted": _ACCEPTED}
    done = run_script("import json\n" + _SETUP + _BLOCKS, json.dumps(list(blocks.values())), cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(zip(blocks, json.loads(done.stdout.strip().splitlines()[-1]), strict=True))


def _lines(printed: dict, block: str) -> list[str]:
    assert "error" not in printed[block], printed[block]["error"]
    return printed[block]["lines"]


def test_planted_faults_fail_in_one_line_naming_rank_and_op(printed):
    host, mixed, shapes = _lines(printed, "planted")
    assert host.startswith("rank 5: c10d.allreduce_") and "sends host tensors" in host
    assert mixed.startswith("rank 5: aten.add") and "mixes a host tensor (4, 3)" in mixed
    assert "_allgather_base_" in shapes and "12 elements for 4 x 4 ranks" in shapes


def test_ranks_that_disagree_on_a_collective_are_caught(printed):
    """Two rehearsed ranks of one group: the same all-to-all in bf16 on one and float32 on the
    other (torch checks one rank's own tensors only), or one collective fewer."""
    lines = _lines(printed, "disagree")
    assert lines[0] == ("rank 5: call 2 on ep[4-7] is all_to_all of torch.bfloat16 where rank 4 runs "
                        "all_to_all of torch.float32 (NCCL moves one dtype per collective)")
    assert lines[1].startswith("rank 5: 1 collectives on ep[4-7] where rank 4 runs 2")
    assert lines[2] == "agree"


def test_what_gpus_accept_passes_and_is_counted(printed):
    lines = _lines(printed, "accepted")
    assert lines[0] == "not caught"  # a 0-dim host scalar in device work is what CUDA takes
    assert lines[1:3] == ["ep all_gather 1 16 48.0",  # 4 floats, 3 of 4 slices arrive
                          "ep all_reduce 1 40 60.0"]  # 10 floats, 2 (n-1)/n of them
    assert lines[3] == "1"
