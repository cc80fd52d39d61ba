"""Checkpoints: exact resume, atomic and durable layout, pruning, fallbacks, and one-line errors
for damaged or mismatched ones."""

import json
import os
import struct
from pathlib import Path

import pytest
import torch

import longctx_moe.checkpoint.rank_file as rank_file
from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.reader import CheckpointReader
from longctx_moe.checkpoint.resume import maybe_resume
from longctx_moe.checkpoint.steps import find_resume_dir
from longctx_moe.checkpoint.trainer_state import save
from longctx_moe.config import load_config
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.process import RunContext
from longctx_moe.trainer import Trainer, iterate_steps
from tests.trainer.toy import ToyMoE, ToyStepLoader

STEPS, SPLIT = 6, 3


def make(tmp: Path, dtype: str = "fp32", resume: str = "auto", experts: int = 4, keep_last: int = 1):
    cfg = load_config(None, [f"train.param_dtype={dtype}", "train.autocast_dtype=none", f"train.steps={STEPS}",
                             "optim.warmup_steps=2", "optim.lr=1e-2", "model.expert_bias=true",
                             f"checkpoint.resume={resume}", f"checkpoint.keep_last={keep_last}"])
    torch.manual_seed(0)
    model = ToyMoE(experts=experts).to({"fp32": torch.float32, "fp64": torch.float64}[dtype])
    ctx = RunContext(0, 1, 1, torch.device("cpu"), tmp, tmp / "ckpt")
    return Trainer(cfg, parallelize(model)), ToyStepLoader(), ctx


def train(trainer, loader, until):
    for batches in iterate_steps(loader, trainer.step, until):
        trainer.train_step(batches)


def saved_steps(tmp: Path, steps, keep_last: int = 0):
    """A run under `tmp` that saved each of `steps`; returns (trainer, loader, ctx)."""
    trainer, loader, ctx = make(tmp, keep_last=keep_last)
    for step in steps:
        train(trainer, loader, step)
        save(trainer, loader, ctx)
    return trainer, loader, ctx


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("step_*"))


def latest(ctx) -> str:
    return (ctx.ckpt_dir / "latest").read_text().strip()


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_resume_continues_bitwise(tmp_path, dtype):
    ref, ref_loader, _ = make(tmp_path / "ref", dtype)
    train(ref, ref_loader, STEPS)

    first, loader, ctx = make(tmp_path / "run", dtype)
    train(first, loader, SPLIT)
    torch.manual_seed(123)  # RNG state is part of the checkpoint: it must be restored
    step_dir = save(first, loader, ctx)
    assert step_dir.name == "step_00000003" and (ctx.ckpt_dir / "latest").read_text().strip() == step_dir.name
    assert not list(ctx.ckpt_dir.glob(".*tmp"))  # published atomically, nothing half-written left
    rng_at_save = torch.get_rng_state()
    torch.manual_seed(999)

    second, loader2, ctx2 = make(tmp_path / "run", dtype)
    assert maybe_resume(second, loader2, ctx2) == step_dir
    assert second.step == SPLIT and loader2.position == SPLIT and torch.equal(torch.get_rng_state(), rng_at_save)
    train(second, loader2, STEPS)
    for (name, a), b in zip(ref.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # bitwise: same ops in the same order
    sa, sb = ref.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    assert second.model.expert_bias_E.abs().sum() > 0  # the buffer moved and was carried over


def test_keep_last_prunes_and_resume_none_starts_fresh(tmp_path):
    trainer, loader, ctx = make(tmp_path, "fp32")
    for until in (1, 2):
        train(trainer, loader, until)
        save(trainer, loader, ctx)
    assert sorted(p.name for p in ctx.ckpt_dir.glob("step_*")) == ["step_00000002"]
    assert find_resume_dir(ctx.ckpt_dir, "none") is None
    fresh, loader2, ctx2 = make(tmp_path, "fp32", resume="none")
    assert maybe_resume(fresh, loader2, ctx2) is None and fresh.step == 0


def test_mismatched_checkpoints_give_one_line_errors(tmp_path):
    trainer, loader, ctx = make(tmp_path)
    train(trainer, loader, 1)
    step_dir = save(trainer, loader, ctx)

    other, loader2, ctx2 = make(tmp_path, experts=6)  # a different model shape
    with pytest.raises(CheckpointError, match="router_DE.*shape") as e:
        maybe_resume(other, loader2, ctx2)
    assert "\n" not in str(e.value)

    with pytest.raises(CheckpointError, match="model.num_experts=8 but the config has 16"):
        CheckpointReader(step_dir, {"model": {"num_experts": 16}})


# ---------------------------------------------------------------------- pruning by step order


def test_save_below_existing_higher_steps_survives_pruning_and_is_resumed(tmp_path):
    # A reused run directory: steps 3 and 4 of an earlier run. The new run saves step 1 with
    # keep_last=2. Pruning by number alone kept 3 and 4 and deleted step 1 while `latest` named
    # it, so the next resume failed.
    saved_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
    trainer, loader, ctx = make(tmp_path, resume="none", keep_last=2)
    train(trainer, loader, 1)
    assert save(trainer, loader, ctx).is_dir()
    assert names(ctx.ckpt_dir) == ["step_00000001"] and latest(ctx) == "step_00000001"
    # The abandoned run's steps are set aside, not deleted.
    assert names(ctx.ckpt_dir / "superseded") == ["step_00000003", "step_00000004"]

    again, loader2, ctx2 = make(tmp_path, keep_last=2)
    assert maybe_resume(again, loader2, ctx2) == ctx.ckpt_dir / "step_00000001" and again.step == 1
    for until in (2, 3):  # the new run prunes its own steps as usual
        train(again, loader2, until)
        save(again, loader2, ctx2)
    assert names(ctx.ckpt_dir) == ["step_00000002", "step_00000003"] and latest(ctx) == "step_00000003"


def test_resume_none_sets_the_old_run_aside_at_start(tmp_path, capsys):
    saved_steps(tmp_path, [1, 2])
    fresh, loader, ctx = make(tmp_path, resume="none")
    assert maybe_resume(fresh, loader, ctx) is None and fresh.step == 0
    assert names(ctx.ckpt_dir) == [] and not (ctx.ckpt_dir / "latest").exists()
    assert names(ctx.ckpt_dir / "superseded") == ["step_00000001", "step_00000002"]
    assert "moved step_00000001, step_00000002" in capsys.readouterr().out
    # A crash before the fresh run's first save: rerunning with auto starts over too.
    assert find_resume_dir(ctx.ckpt_dir, "auto") is None


def test_resume_from_an_older_step_sets_the_later_ones_aside(tmp_path, capsys):
    _, _, ctx = saved_steps(tmp_path, [1, 2, 3])
    back, loader, ctx2 = make(tmp_path, resume=str(ctx.ckpt_dir / "step_00000001"))
    maybe_resume(back, loader, ctx2)
    assert back.step == 1 and names(ctx.ckpt_dir) == ["step_00000001"]
    assert names(ctx.ckpt_dir / "superseded") == ["step_00000002", "step_00000003"]
    capsys.readouterr()
    # `latest` named step 3: gone with it. A rerun with auto (say, after a crash before the
    # first save) takes step 1, the step this run continues from, with a notice.
    assert find_resume_dir(ctx.ckpt_dir, "auto") == ctx.ckpt_dir / "step_00000001"
    assert "is missing; resuming from the newest complete step" in capsys.readouterr().out


# ---------------------------------------------------------------------- durability and fallbacks


def test_save_fsyncs_files_then_directory_entries(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    trainer, loader, ctx = make(tmp_path)
    train(trainer, loader, 1)
    save(trainer, loader, ctx)
    # Data before the names that publish it: the rank file and meta.json, the temp step directory
    # (their entries), the checkpoint directory (the step's rename), then `latest` and its rename.
    assert synced.index("rank_00000.safetensors") < synced.index(".step_00000001.tmp")
    assert synced.index("meta.json") < synced.index(".step_00000001.tmp") < synced.index("ckpt")
    assert synced[-2:] == ["latest.tmp", "ckpt"]


def test_missing_or_dangling_latest_falls_back_to_the_newest_complete_step(tmp_path, capsys):
    _, _, ctx = saved_steps(tmp_path, [1, 2])
    d, lat = ctx.ckpt_dir, ctx.ckpt_dir / "latest"

    def resumed_from():
        step_dir = find_resume_dir(d, "auto")
        notice = capsys.readouterr().out.strip()
        assert "\n" not in notice
        return step_dir.name, notice

    assert resumed_from() == ("step_00000002", "")
    lat.unlink()  # a crash between publishing the step and writing `latest`
    name, notice = resumed_from()
    assert name == "step_00000002" and notice.startswith(f"notice: '{lat}' is missing")
    lat.write_text("step_00000099\n")
    name, notice = resumed_from()
    assert name == "step_00000002" and "names 'step_00000099', which is missing" in notice
    lat.write_bytes(b"\xff\xfe\x00garbage")
    assert resumed_from()[0] == "step_00000002"
    (d / "step_00000002" / "meta.json").write_bytes(b"\x00" * 40)  # a damaged meta.json
    lat.write_text("step_00000002\n")
    name, notice = resumed_from()
    assert name == "step_00000001" and "no readable meta.json" in notice
    (d / "step_00000001" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="holds no complete step; set checkpoint.resume=none") as e:
        find_resume_dir(d, "auto")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- damaged files


def _header(path: Path) -> tuple[int, dict]:
    """(header length, header JSON) of a safetensors file: 8 bytes little-endian length, then JSON."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def _xor(path: Path, offset: int, count: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset: offset + count] = bytes(b ^ 0xFF for b in raw[offset: offset + count])
    path.write_bytes(bytes(raw))


def flip_16_tensor_bytes(path: Path) -> None:
    n, header = _header(path)
    begin, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[1] - o[0])
    _xor(path, 8 + n + (begin + end) // 2, 16)  # inside the largest tensor
    # Without a checksum this loads silently: safetensors checks no tensor bytes.
    from safetensors.torch import load_file

    assert load_file(str(path))


def corrupt_header(path: Path) -> None:
    _xor(path, 7, 1)  # the top byte of the header length: ~7e16 bytes, past the end of the file
    with pytest.raises(Exception) as e:  # what a reader without the checksum meets
        from safetensors import safe_open

        safe_open(str(path), framework="pt")
    assert not isinstance(e.value, CheckpointError)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {"16 flipped tensor bytes": (flip_16_tensor_bytes, "fails its sha256 check"),
           "corrupt header": (corrupt_header, "fails its sha256 check"),
           "truncated": (truncate, r"has \d+ bytes but meta.json records \d+ \(truncated"),
           "deleted": (Path.unlink, "is missing")}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_rank_file_is_one_line_naming_the_file_and_the_older_step(tmp_path, damage):
    _, _, ctx = saved_steps(tmp_path, [1, 2])
    part = ctx.ckpt_dir / "step_00000002" / "rank_00000.safetensors"
    corrupt, expected = DAMAGES[damage]
    corrupt(part)
    # Named by path: with resume=auto a missing or resized file makes the step torn and skipped
    # (tests/trainer/test_torn_steps.py); a file that keeps its size fails its checksum either way.
    with pytest.raises(CheckpointError, match=f"'{part}' {expected}") as e:
        maybe_resume(*make(tmp_path, resume=str(part.parent)))
    assert "\n" not in str(e.value)
    assert str(e.value).endswith(f"--set checkpoint.resume={ctx.ckpt_dir / 'step_00000001'}")


def test_unverified_corrupt_header_is_one_line(tmp_path):
    # meta.json without checksums (edited by hand): the reader's own error must be caught.
    _, _, ctx = saved_steps(tmp_path, [1])
    step_dir = ctx.ckpt_dir / "step_00000001"
    meta = json.loads((step_dir / "meta.json").read_text())
    del meta["files"]
    (step_dir / "meta.json").write_text(json.dumps(meta))
    corrupt_header(step_dir / "rank_00000.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot be read as safetensors \(\w+\): it is corrupt; no older step") as e:
        maybe_resume(*make(tmp_path))
    assert "\n" not in str(e.value)


def test_meta_records_each_rank_files_size_and_sha256(tmp_path):
    _, _, ctx = saved_steps(tmp_path, [1])
    step_dir = ctx.ckpt_dir / "step_00000001"
    files = json.loads((step_dir / "meta.json").read_text())["files"]
    part = step_dir / "rank_00000.safetensors"
    assert files == {"rank_00000.safetensors": {"bytes": part.stat().st_size, "block_bytes": rank_file.HASH_BLOCK,
                                                 "block_sha256": rank_file.block_sha256_file(part)}}


def test_async_save_holds_the_state_of_its_step_and_publishes_when_finished(tmp_path):
    from longctx_moe.checkpoint.trainer_state import Checkpointer

    ref, ref_loader, _ = make(tmp_path / "ref")
    train(ref, ref_loader, STEPS)

    trainer, loader, ctx = make(tmp_path / "run")
    trainer.cfg.checkpoint.async_save = True
    train(trainer, loader, SPLIT)
    saver = Checkpointer(trainer, loader, ctx)
    saver.save()
    assert saver.pending is not None
    train(trainer, loader, SPLIT + 1)  # training goes on while the file is written
    saver.poll()
    saver.finish()
    assert saver.pending is None and latest(ctx) == "step_00000003"

    again, loader2, ctx2 = make(tmp_path / "run")
    maybe_resume(again, loader2, ctx2)
    assert again.step == SPLIT and loader2.position == SPLIT  # the copy taken at the save
    train(again, loader2, STEPS)
    for (name, a), b in zip(ref.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_harmless_settings_may_change_on_resume_but_the_models_function_may_not(tmp_path):
    import copy

    from longctx_moe.checkpoint.trainer_state import resume_expectations

    trainer, _, ctx = saved_steps(tmp_path, [1])
    step_dir = ctx.ckpt_dir / "step_00000001"
    harmless = {"model": {"init_std": 0.5},
                "execution": {"attention_backend": "reference", "expert_precision": "param", "grouped_gemm": "loop",
                              "loss_chunk_tokens": 77, "kernels": "torch", "fp8": "torch"},
                "balance": {"aux_loss_coeff": 0.5, "z_loss_coeff": 0.0},
                "parallel": {"dispatch_dtype": "bf16", "capacity_factor": 1.5, "dp": 1, "tp": 2, "ep": 4}}
    cfg = copy.deepcopy(trainer.cfg)
    for section, values in harmless.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    CheckpointReader(step_dir, resume_expectations(cfg))  # accepted
    for key, value in (("hidden_size", 64), ("router_score", "sigmoid"), ("top_k", 1)):
        cfg = copy.deepcopy(trainer.cfg)
        setattr(cfg.model, key, value)
        with pytest.raises(CheckpointError, match=rf"has model\.{key}=\S+ but the config has {value!r}") as e:
            CheckpointReader(step_dir, resume_expectations(cfg))
        assert "\n" not in str(e.value)


def test_a_checkpoint_whose_model_section_still_holds_the_balance_keys_resumes(tmp_path):
    """Checkpoints written while model.* held the balance losses (now balance.*, a training
    setting that may change on resume) and max_position_embeddings 0 (then: unset; it acts
    only as YaRN's missing factor) resume; a difference in the model's function still refuses."""
    import dataclasses

    from longctx_moe.checkpoint.trainer_state import resume_expectations

    trainer, _, ctx = saved_steps(tmp_path, [1])
    step_dir = ctx.ckpt_dir / "step_00000001"
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["model"].update(aux_loss_type="switch", aux_loss_coeff=0.5, z_loss_coeff=0.0,
                         expert_bias_update_rate=0.1, max_position_embeddings=0)
    (step_dir / "meta.json").write_text(json.dumps(meta))
    assert "aux_loss_coeff" not in resume_expectations(trainer.cfg)["model"]
    CheckpointReader(step_dir, resume_expectations(trainer.cfg))  # accepted
    yarn = {"type": "yarn", "original_max_position_embeddings": 1024}  # the factor from the length
    cfg = dataclasses.replace(trainer.cfg, model=dataclasses.replace(trainer.cfg.model, rope_scaling=yarn))
    assert resume_expectations(cfg)["model"]["max_position_embeddings"] == 32768
    cfg = dataclasses.replace(trainer.cfg, model=dataclasses.replace(trainer.cfg.model, top_k=1))
    with pytest.raises(CheckpointError, match=r"has model\.top_k=2 but the config has 1"):
        CheckpointReader(step_dir, resume_expectations(cfg))


def test_rank_files_are_safetensors_that_safetensors_reads_back_exactly(tmp_path):
    # Our writer streams the format itself (no in-memory copy of the file): check it against the
    # safetensors reader for every dtype and shape kind a trainer can hold.
    from safetensors import safe_open
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 4, generator=gen), "scalar": torch.tensor(2.0),
               "f64": torch.randn(5, generator=gen, dtype=torch.float64),
               "bf16": torch.randn(2, 3, generator=gen).bfloat16(), "empty": torch.zeros(0, 3),
               "bool": torch.tensor([True, False]), "i64": torch.arange(7)}
    path = tmp_path / "x.safetensors"
    entry = rank_file.write_rank_file(path, tensors, {"state": "{}"})
    assert entry == {"bytes": path.stat().st_size, "block_bytes": rank_file.HASH_BLOCK,
                     "block_sha256": rank_file.block_sha256_file(path)}
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    assert safe_open(str(path), framework="pt").metadata() == {"state": "{}"}


def test_every_block_is_checked_and_whole_file_entries_still_verify(tmp_path, monkeypatch):
    """Files of several checksum blocks (64 bytes here): meta.json's list covers every block, the
    file reads back exactly, an entry of an older checkpoint (one sha256 of the whole file) is
    verified too, and one flipped byte in the last block is caught under either entry."""
    import hashlib

    monkeypatch.setattr(rank_file, "HASH_BLOCK", 64)
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.arange(100, dtype=torch.float64), "b": torch.randn(7, 5, generator=gen)}
    path = tmp_path / "x.safetensors"
    entry = rank_file.write_rank_file(path, tensors, {"state": "{}"})
    assert entry["block_bytes"] == 64 and len(entry["block_sha256"]) == -(-entry["bytes"] // 64) > 10
    assert entry["block_sha256"] == rank_file.block_sha256_file(path, 64)
    old = {"bytes": entry["bytes"], "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    for e in (entry, old):
        back = rank_file.read_verified(path, e)
        assert all(torch.equal(back.get_tensor(k), v) for k, v in tensors.items())
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    path.write_bytes(bytes(raw))
    for e in (entry, old):
        with pytest.raises(CheckpointError, match="fails its sha256 check"):
            rank_file.read_verified(path, e)


def test_a_pickled_checkpoint_of_format_2_is_refused_in_one_line(tmp_path):
    _, _, ctx = saved_steps(tmp_path, [1])
    step_dir = ctx.ckpt_dir / "step_00000001"
    meta = json.loads((step_dir / "meta.json").read_text())
    (step_dir / "meta.json").write_text(json.dumps({**meta, "format": 2}))
    with pytest.raises(CheckpointError, match=r"has format 2 \(pickled rank files of an older longctx_moe\); "
                                              "resume it with that version or set checkpoint.resume=none$"):
        maybe_resume(*make(tmp_path))
