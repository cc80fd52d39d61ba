"""Weight sync by shard (longctx_moe/hf/shards.py): every rank's pieces reassemble bitwise into the
whole-tensor export, each element exactly once, and the bytes a rank yields stay within 1.1 x model
bytes / world, on 4 and 8 gloo ranks under EP, TP and ETP layouts of configs/tiny_cpu.yaml, and
for the families whose experts or attention have their own layouts (gpt-oss's fused, interleaved
experts with biases; DeepSeek-V3's MLA, dense first layer and shared expert)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from longctx_moe.config import load_config
from longctx_moe.hf.shards import ShardRecord, reassemble
from rl_hooks import PolicyTrainer
from tests.launcher import run_distributed

ROOT = Path(__file__).resolve().parents[2]
TINY, GPT_OSS, DEEPSEEK = (str(ROOT / "configs" / f) for f in (
    "tiny_cpu.yaml", "families/gpt_oss_tiny.yaml", "families/deepseek_v3_tiny.yaml"))
# (config, parallel layout) per case: experts over EP with DP, TP x DP (experts replicated on every
# rank), TP with EP (EDP replicas), ETP (experts' hidden units split); gpt-oss's fused experts under
# ETP and DeepSeek-V3's MLA under TP, on 4 ranks.
LAYOUTS = {
    "tiny4": [(TINY, ["parallel.ep=4"]), (TINY, ["parallel.tp=2"]), (TINY, ["parallel.tp=2", "parallel.ep=2"])],
    "tiny8": [(TINY, ["parallel.ep=8"]), (TINY, ["parallel.tp=2"]),
              (TINY, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"])],
    "families4": [(GPT_OSS, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=2"]),
                  (DEEPSEEK, ["parallel.tp=2", "parallel.ep=2"])],
}
BOUND = 1.1  # the acceptance bound on a rank's bytes over model bytes / world


def _detached(records) -> list[ShardRecord]:
    # records may view the parameters: copies travel back to the parent
    return [dataclasses.replace(r, tensor=r.tensor.clone()) for r in records]


def _rank(rank: int, world: int, case: str) -> list[dict]:
    out = []
    for path, sets in LAYOUTS[case]:
        policy = PolicyTrainer(load_config(path, sets))
        whole = {n: t.clone() for bucket in policy.export_weights() for n, t in bucket}  # collective
        out.append({"records": _detached(policy.export_weight_shards()),
                    "whole": whole if rank == 0 else None, "specs": policy.weights_spec()})
    return out


def _check(case: str, world: int) -> None:
    runs = run_distributed(_rank, world_size=world, args=(case,), timeout=600)
    for i, (path, sets) in enumerate(LAYOUTS[case]):
        what = f"{path.rsplit('/', 1)[1]} {sets} on {world} ranks"
        per_rank = [run[i]["records"] for run in runs]
        whole = runs[0][i]["whole"]
        got = reassemble([r for records in per_rank for r in records], runs[0][i]["specs"])
        assert list(got) == list(whole), what
        for name, want in whole.items():
            assert torch.equal(got[name], want), f"{what}: {name}"
        total = sum(t.numel() * t.element_size() for t in whole.values())
        sent = [sum(r.nbytes for r in records) for records in per_rank]
        assert max(sent) <= BOUND * total / world, f"{what}: per-rank bytes {sent}, model {total}"
        for records in per_rank:  # one piece of a tensor per rank, in export order
            names = [r.hf_name for r in records]
            assert names == [n for n in whole if n in set(names)], what


@pytest.mark.multirank  # the feature's one fast multi-rank test
def test_shards_reassemble_to_the_whole_export_within_the_byte_bound_on_4_ranks():
    _check("tiny4", 4)


@pytest.mark.slow  # 8 gloo ranks
def test_shards_reassemble_to_the_whole_export_within_the_byte_bound_on_8_ranks():
    _check("tiny8", 8)


@pytest.mark.slow  # 4 gloo ranks, two more families
def test_fused_experts_and_mla_shards_reassemble_to_the_whole_export():
    _check("families4", 4)


def test_one_process_yields_every_tensor_whole_as_the_export():
    policy = PolicyTrainer(load_config(TINY, []))
    whole = [(n, t.clone()) for bucket in policy.export_weights() for n, t in bucket]
    records = list(policy.export_weight_shards())
    assert [r.hf_name for r in records] == [n for n, _ in whole]
    for r, (name, t) in zip(records, whole, strict=True):
        assert r.slices == tuple((0, n) for n in t.shape) and r.full_shape == tuple(t.shape)
        assert r.dtype == torch.bfloat16 and torch.equal(r.tensor, t), name


def _record(name, slices, value=1.0):
    shape = tuple(b - a for a, b in slices)
    return ShardRecord(name, (4, 2), torch.float32, slices, torch.full(shape, value))


def test_reassemble_checks_every_element_comes_once():
    halves = [_record("w", ((0, 2), (0, 2)), 1.0), _record("w", ((2, 4), (0, 2)), 2.0)]
    got = reassemble(halves)["w"]
    assert torch.equal(got, torch.tensor([[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2))
    with pytest.raises(ValueError, match="overlap"):
        reassemble([*halves, _record("w", ((1, 2), (0, 1)))])
    with pytest.raises(ValueError, match="2 of 8 elements are in no record"):
        reassemble([halves[0], _record("w", ((2, 4), (1, 2)))])
    with pytest.raises(ValueError, match="does not fill"):
        reassemble([ShardRecord("w", (4, 2), torch.float32, ((0, 4), (0, 2)), torch.zeros(2, 2))])


def _verl_rank(rank: int, world: int, folder: str) -> dict:
    from verl.checkpoint_engine.delta_sync.sparse_gather import gather_slot_entries_to_rank0
    from verl.workers.engine_workers import TrainingWorker

    from tests.rl_hooks import verl_cases as vc

    worker = TrainingWorker(vc.worker_config(folder, "float32", ["parallel.tp=2", "parallel.ep=2"]))
    worker.reset()
    engine = worker.engine
    seed = {n: t.clone() for n, t in engine.get_per_tensor_param()[0]}  # collective
    gen, peft = engine.get_per_tensor_param_shard()
    shards = [(n, flat.clone(), spec.place, spec.contributes) for n, flat, spec in gen]
    # verl's delta sync: snapshots of the pieces, weights changed alike on every replica, the
    # changed elements gathered to rank 0 by verl's own gather over each entry's group
    engine.prime_delta_snapshots()
    with torch.no_grad():
        for p in engine.policy.runtime.model.parameters():
            p.view(-1)[::5] += 1.0
    after = {n: t.clone() for n, t in engine.get_per_tensor_param()[0]}
    updated = {n: t.clone().view(-1) for n, t in seed.items()}
    for slots, _, counts, idx, val, group in engine.get_per_tensor_param_delta_shard()[0]:
        gathered = gather_slot_entries_to_rank0(idx, val, counts, group=group)  # None off rank 0
        for (name, _), (aidx, aval) in zip(slots, gathered if rank == 0 else [], strict=rank == 0):
            updated[name][aidx.long()] = aval
    return {"shards": shards, "seed": seed, "after": after, "updated": updated, "peft": peft}


@pytest.mark.slow  # verl's TrainingWorker on 2 gloo ranks
def test_verl_shard_export_and_delta_sync_give_the_whole_tensors(tmp_path):
    pytest.importorskip("verl")
    from tests.rl_hooks import verl_cases as vc

    folder = vc.save_hf_model(tmp_path / "hf", "float32")
    runs = run_distributed(_verl_rank, world_size=2, args=(str(folder),), timeout=600)
    seed, names = runs[0]["seed"], list(runs[0]["seed"])
    records = []
    for run in runs:
        assert [n for n, *_ in run["shards"]] == names and run["peft"] is None  # lockstep
        for name, flat, place, contributes in run["shards"]:
            if not contributes:
                assert flat.numel() == 0
                continue
            slices = tuple((o, o + n) for o, n in zip(place.global_offset, place.local_shape, strict=True))
            records.append(ShardRecord(name, place.full_shape, flat.dtype, slices, flat.view(place.local_shape)))
    got = reassemble(records)
    assert set(got) == set(names) and all(torch.equal(got[n], seed[n]) for n in names)
    # every element once: the pieces of a tensor reached rank 0 and nothing else changed
    after = runs[0]["after"]
    changed = sum(int((after[n] != seed[n]).sum()) for n in names)
    assert changed > 0
    for name in names:
        assert torch.equal(runs[0]["updated"][name].view(seed[name].shape), after[name]), name
