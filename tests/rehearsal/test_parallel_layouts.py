"""The layouts beyond EP rehearse on the shrunk Qwen3-30B-A3B (two layers, 4,096 tokens, a rank
of 16): CP ring (point-to-point) with TP, sequence parallelism and expert TP, Ulysses, and
Dynamic-CP on hierarchical groups. Each rehearsed rank is the second of its CP group, which
counts no target tokens of its own in the step totals unless host collectives answer as a job
would. Each rehearsal runs in processes of its own (one default process group per process)."""

import json
from pathlib import Path

import pytest

from tests.launcher import run_script
from tests.rehearsal.helpers import rehearse_one

ROOT = Path(__file__).resolve().parents[2]
LAYERS, TOKENS = 2, 4096
KV_HEADS, HEAD_DIM = 4, 128  # configs/models/qwen3-30b-a3b.json


def _rehearse(tmp_path, rank: int, *sets: str) -> dict:
    report = rehearse_one(tmp_path, "--config", "configs/rehearsal/qwen3-30b-a3b.yaml", "--world", "16", "--rank",
                          str(rank), "--tokens", str(TOKENS),
                          sets=(f"model.num_layers={LAYERS}", "train.recompute=none", *sets))
    assert report["fits"] and report["peak_split"]["parameters"] == 4 * report["params"]  # float32 masters
    return report


def _only_the_step_reads(report: dict, *also: str) -> None:
    """The host reads are the step's own (its loss sums, the gradient norm, the routing seam)
    and `also`: the layout's paths add no device-to-host sync."""
    allowed = ("trainer.py", "(global_norm)", "RoutingCounts.read", *also)
    assert all(any(a in where for a in allowed) for where in report["host_reads"]), report["host_reads"]


@pytest.mark.slow
def test_ring_cp_with_tp_sequence_parallel_and_expert_tp(tmp_path):
    r = _rehearse(tmp_path, 7, "parallel.cp=2", "parallel.cp_backend=ring", "parallel.tp=2",
                  "parallel.sequence_parallel=true", "parallel.etp=2")
    assert r["roles"]["cp"] == 1 and r["roles"]["tp"] == 1 and r["roles"]["etp"] == 1
    t = r["traffic"]
    # Ring rank 1 of 2, per layer: the K|V halves A and B forward and again backward (bf16), and
    # the dK|dV accumulator of half A home (float32); it receives A forward and backward, the
    # accumulator A and its own block's B home.
    send, recv = t["cp[5..7] send"], t["cp[5..7] recv"]
    assert (send["calls"], recv["calls"]) == (5 * LAYERS, 4 * LAYERS)
    row = KV_HEADS // 2 * 2 * HEAD_DIM  # K | V of the TP rank's kv heads
    half, rest = divmod(send["payload_bytes"], LAYERS * row * (4 * 2 + 4))
    # whole rows of a zigzag half of the 2,048 local tokens (and of their padding: each document is
    # padded to a multiple of 2 x cp x tp)
    assert rest == 0 and TOKENS // 8 < half <= TOKENS // 4 * 1.05
    assert recv["payload_bytes"] == 0 and send["bus_bytes"] == send["payload_bytes"]
    assert t["tp[6..7] reduce_scatter"]["calls"] >= 2 * LAYERS  # each TP region's exit, forward
    assert t["tp[6..7] all_gather"]["calls"] >= 2 * LAYERS  # and entry
    assert t["etp[6..7] all_to_all"]["payload_bytes"] > 0
    _only_the_step_reads(r)


@pytest.mark.slow
def test_ulysses_cp_with_the_global_batch_aux_loss(tmp_path):
    """The global-batch aux loss weighs each micro-batch by the targets of every one run i-th
    over dp_cp: a host sum (read back from the device, it was a sync per micro-batch)."""
    r = _rehearse(tmp_path, 5, "parallel.cp=2", "parallel.cp_backend=ulysses",
                  "parallel.aux_loss_scope=global_batch", "balance.aux_loss_type=switch")
    assert r["roles"]["cp"] == 1
    a2a = r["traffic"]["cp[4..5] all_to_all"]
    # per layer: q, k, v scattered and the output gathered; backward the reverse, with the
    # log-sum-exp for the attention backward
    assert a2a["calls"] == 9 * LAYERS
    scattered = LAYERS * 2 * TOKENS // 2 * 2 * (32 + 4) * HEAD_DIM  # forward q|k|v, backward dout|dk|dv: bf16
    assert scattered < a2a["payload_bytes"] < 2.2 * scattered
    assert not any(k.startswith("cp[4..5] send") for k in r["traffic"])
    _only_the_step_reads(r)


@pytest.mark.slow
def test_dynamic_cp_on_hierarchical_groups(tmp_path):
    r = _rehearse(tmp_path, 5, "parallel.cp=4", "parallel.cp_backend=hierarchical",
                  "parallel.hierarchical_sizes=[2,2]", "parallel.dynamic_cp=true")
    assert r["roles"]["cp"] == 1
    t = r["traffic"]
    # the step's document lengths: two host all-gathers over DP (by design), the documents on
    # the device over dp_cp and read back once
    assert r["host_collectives"]["parallel/dynamic_cp.py (_gather_host)"] == 2
    assert t["dp_cp[0..15] all_to_all"]["calls"] == 1
    # the slots run on a Dynamic-CP group of 4: Ulysses inside each pair, a ring over the pairs
    assert t["cp_inner[4..5] all_to_all"]["calls"] > 0
    assert t["dcp4_outer[5..7] send"]["payload_bytes"] > 0 and t["dcp4_outer[5..7] recv"]["calls"] > 0
    _only_the_step_reads(r, "(exchange_documents)")


_RULES = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from longctx_moe.rehearsal.collectives import DeviceRules, RehearsalFault, check_agreement
from longctx_moe.parallel.comm import host_collective
from cp_attention.comm import post_p2p, wait_all
import sys, json
me = int(sys.argv[1])
dist.init_process_group("meta:fake,cpu:fake,cuda:fake", store=FakeStore(), rank=me, world_size=8)
cp = dist.new_group([4, 5, 6, 7])
meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, device="meta", dtype=dtype)
rules = DeviceRules(rank=me, group_names={cp.group_name: "cp"})
if me == 4:  # group rank 0 receives from 1, in float32
    with rules:
        wait_all(post_p2p([(False, meta(8, 4, dtype=torch.float32), 1, 0, "kv")], cp, None))
    print(json.dumps(dict(rules.calls)))
    raise SystemExit
with rules:  # group rank 1 sends down to 0 (bf16), receives from 2
    wait_all(post_p2p([(True, meta(8, 4), 0, 0, "kv"), (False, meta(8, 4), 2, 0, "kv")], cp, None))
for (group, kind), t in sorted(rules.traffic.items()):
    print(group, kind, t.calls, t.payload_bytes)
try:
    with rules:
        wait_all(post_p2p([(True, torch.ones(4), 0, 0, "kv")], cp, None))
except RehearsalFault as e:
    print(str(e).split(" at ")[0], "host" in str(e))
@host_collective
def totals(t, op=dist.ReduceOp.SUM):
    dist.all_reduce(t, op=op, group=cp)
    return t
with rules:
    print(totals(torch.tensor([3.0, 0.5], dtype=torch.float64)).tolist(), totals(torch.tensor([3.0]), dist.ReduceOp.MAX).tolist())
print(json.dumps(dict(rules.calls)))
"""


def _rules(rank: int) -> list[str]:
    done = run_script(_RULES, str(rank), cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


@pytest.mark.slow
def test_device_rules_check_and_count_point_to_point_and_answer_host_totals_as_a_job():
    from longctx_moe.rehearsal.collectives import RehearsalFault, check_agreement

    lines, (peer,) = _rules(5), _rules(4)
    assert lines[:2] == ["cp recv 1 0", "cp send 1 64"]  # 8 x 4 bf16 sent; receives count calls
    assert lines[2] == "rank 5: c10d.send.default True"  # NCCL sends device memory only
    assert lines[3] == "[12.0, 2.0] [3.0]"  # 4 alike ranks: a sum is 4 times this rank's, a max its own
    calls = json.loads(lines[4])
    assert set(calls) == {"cp p2p 1->0", "cp p2p 2->1"}  # a sequence per (sender, receiver)
    with pytest.raises(RehearsalFault, match=r"^rank 5: call 1 on cp p2p 1->0 is p2p of torch.bfloat16 where "
                                             r"rank 4 runs p2p of torch.float32"):
        check_agreement({4: json.loads(peer), 5: calls})
    check_agreement({4: {"cp p2p 1->0": calls["cp p2p 1->0"]}, 5: calls})  # the matching receive
