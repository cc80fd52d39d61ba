"""bench/gpu_check.py, the program a lent GPU runs, on CPU (--quick): the section filter, the
config overrides and the profile tables it is rerun with must work before a GPU is lent, since
device time does not allow debugging there."""

from __future__ import annotations

import json

import pytest

from bench import gpu_check

pytestmark = pytest.mark.slow


def test_quick_run_of_chosen_sections_with_overrides_and_profile(tmp_path):
    out, prof = tmp_path / "gpu_check.json", tmp_path / "prof"
    rc = gpu_check.main(["--quick", "--device", "cpu", "--out", str(out), "--sections", "time.trainer_step",
                         "--set", "train.recompute=full", "--profile-dir", str(prof)])
    res = json.loads(out.read_text())
    assert rc == 0
    # the trainer section needs the peak (its MFU denominator); nothing else was asked for
    ran = {k for k, v in res.items() if isinstance(v, dict) and k != "host"}
    assert ran == {"time.peak_matmul", "time.trainer_step"}, ran
    assert ran <= set(gpu_check.SECTIONS)
    step = res["time.trainer_step"]
    assert step["recompute"] == "full" and res["sets"] == ["train.recompute=full"]
    assert step["mfu"] is not None and step["tokens_per_s"] > 0 and step["skipped_steps"] == 0
    table = (prof / "profile_trainer_step.txt").read_text()
    assert "aten::mm" in table and "Self CPU time total" in table


def test_the_fp8_check_says_why_it_is_skipped_on_cpu(tmp_path):
    out = tmp_path / "fp8.json"
    assert gpu_check.main(["--quick", "--device", "cpu", "--out", str(out), "--sections", "check.fp8"]) == 0
    res = json.loads(out.read_text())
    assert res["check.fp8"]["ok"] is None and "FP8 tensor cores" in res["check.fp8"]["skipped"]
    assert "time.peak_matmul" not in res


def test_a_section_name_that_matches_nothing_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "x.json"), "--sections",
                        "time.trainer_step,time.trainr"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'time.trainr' names no section" in err and "time.trainer_step" in err
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------- the memory-truth section


def test_gpu_check_sh_parses_and_its_memory_section_calls_the_helper_with_arguments_it_takes():
    import re
    import shlex
    import subprocess
    from pathlib import Path

    from bench import memory_truth_gpu

    script = Path(gpu_check.__file__).with_suffix(".sh")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    (line,) = re.findall(r"^section memory_truth (\d+) \$PY (bench/\S+) (.*)$", script.read_text(), re.M)
    limit, path, rest = line
    assert path == "bench/memory_truth_gpu.py" and 0 < int(limit) <= 120
    args = memory_truth_gpu._parser().parse_args(shlex.split(rest.replace('"$OUT', '"/tmp/out')))
    assert args.out == "/tmp/out/memory_truth.json" and not args.rehearse_only and args.device == "cuda"
    assert "$rc_mem" in script.read_text().split("for r in", 1)[1]  # its failure fails the script


def test_memory_truth_rehearsal_half_runs_without_a_gpu(tmp_path):
    from bench import memory_truth_gpu

    out = tmp_path / "m.json"
    assert memory_truth_gpu.main(["--rehearse-only", "--quick", "--gpu", "h200", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["gpu"] == "h200" and res["tokens"] >= 2048 and "real_peak_bytes" not in res
    split = res["rehearsed_split_gib"]
    assert res["rehearsed_peak_bytes"] > 0 and split["parameters"] > 0 and split["activations"] > 0
    assert "mem_ratio_gpu" not in res  # no real half, no ratio
    assert memory_truth_gpu.gpu_kind("NVIDIA H200") == "h200" and memory_truth_gpu.gpu_kind("Tesla T4") is None


@pytest.mark.parametrize("argv, says", [
    (["--rehearse-only", "--quick"], "--rehearse-only has no device to name it"),
    (["--device", "cpu"], "the real step measures CUDA memory"),
    (["--quick"], "sees no CUDA device"),
])
def test_memory_truth_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys, argv, says):
    import torch

    from bench import memory_truth_gpu

    if says == "sees no CUDA device" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit):
        memory_truth_gpu.main([*argv, "--out", str(tmp_path / "m.json")])
    assert says in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "m.json").exists()


# ---------------------------------------------------------------- the offload section


def test_gpu_check_sh_runs_the_offload_section_and_folds_its_json_into_memory_truth(tmp_path):
    """Its own section with a timeout, arguments its parser takes, its failure failing the script,
    its JSON folded into memory_truth.json (the device call brings back 8 files), and the
    timeouts within the script's 8 minutes."""
    import re
    import shlex
    import subprocess
    from pathlib import Path

    from bench import offload_gpu

    text = Path(gpu_check.__file__).with_suffix(".sh").read_text()
    (line,) = re.findall(r"^section offload_gpu (\d+) \$PY (bench/\S+) (.*)$", text, re.M)
    limit, path, rest = line
    assert path == "bench/offload_gpu.py" and 0 < int(limit) <= 60
    args = offload_gpu._parser().parse_args(shlex.split(rest))
    assert not args.quick and args.out.startswith("/tmp/")
    assert "$rc_offload" in text.split("for r in", 1)[1]
    assert sum(int(s) for s in re.findall(r"^\s*section \S+ (\d+) ", text, re.M)) <= 480  # under 8 minutes
    # the fold, run as the script runs it: into an existing memory_truth.json and into none
    fold = re.search(r'^\$PY - "\$OUT/memory_truth.json" (\S+) <<\'PYEOF\' \|\| true\n(.*?)^PYEOF$',
                     text, re.M | re.S)
    assert fold and fold.group(1) == args.out
    main, offload = tmp_path / "memory_truth.json", tmp_path / "offload.json"
    main.write_text(json.dumps({"mem_ratio_gpu": 1.01}))
    offload.write_text(json.dumps({"offload_bitwise": True}))
    for _ in range(2):
        subprocess.run(["python3", "-", str(main), str(offload)], input=fold.group(2), text=True, check=True)
        assert json.loads(main.read_text()) == {"mem_ratio_gpu": 1.01, "offload_gpu": {"offload_bitwise": True}}
    main.unlink()
    subprocess.run(["python3", "-", str(main), str(offload)], input=fold.group(2), text=True, check=True)
    assert json.loads(main.read_text()) == {"offload_gpu": {"offload_bitwise": True}}


def test_offload_check_runs_on_cpu_with_the_copies_forced(tmp_path):
    """The GPU section's whole path on the tiny model: every storage freed and its bytes sent,
    back exactly, the step after the round trip bitwise; optim.offload=cpu's losses against the
    device optimizer's (bitwise on a CPU: the same fused kernel on both), with updates large
    enough for the GPU's tolerance to tell a lost one from rounding."""
    from bench import offload_gpu

    out = tmp_path / "offload.json"
    assert offload_gpu.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["offload_bitwise"] is True and res["offload_residual_frac_gpu"] is None  # no GPU here
    for dtype in ("fp32", "bf16"):
        trip = res[f"round_trip.{dtype}"]
        assert trip["storage_bytes_after"] == 0 and sum(trip["sent_bytes"].values()) == trip["storage_bytes_before"]
        assert trip["back_bytes"] == trip["sent_bytes"] and trip["sent_bytes"]["grads"] > 0
    # bf16 weights: half the parameter bytes, the fp32 masters with the optimizer
    fp32, bf16 = res["round_trip.fp32"]["sent_bytes"], res["round_trip.bf16"]["sent_bytes"]
    assert bf16["params"] < fp32["params"] and bf16["optimizer"] > fp32["optimizer"]
    opt = res["optim_offload"]
    assert opt["ok"] and res["optim_offload_max_rel_loss_diff"] == 0.0
    assert opt["min_loss_change"] > 10 * offload_gpu.OPTIM_TOL
    assert opt["cpu"]["optimizer_host_bytes"] >= 2 * opt["adamw_moment_bytes"]  # masters, gradients, moments


# ---------------------------------------------------------------- the peers section


def test_gpu_check_sh_runs_each_peer_in_its_own_section_and_folds_them_into_gpu_check(tmp_path):
    """One section per peer with arguments bench/peers_gpu.py takes, torchtitan with the carried
    wheels' directory on PYTHONPATH, both failures failing the script, and the fold into
    gpu_check.json beside ours (the trainer section's figure), with a peer's file missing too."""
    import re
    import shlex
    import subprocess
    from pathlib import Path

    from bench import peers_gpu

    text = Path(gpu_check.__file__).with_suffix(".sh").read_text().replace("\\\n", "")
    lines = dict(re.findall(r"^section peers_(\w+) \d+ (.*)$", text, re.M))
    assert set(lines) == {"torchtitan", "transformers"}
    outs = {}
    for name, rest in lines.items():
        words = shlex.split(rest)
        if name == "torchtitan":
            assert words[0] == "env" and words[1].startswith("PYTHONPATH=$TT:")
            assert re.search(r'--target "\$TT" bench/wheels/\*\.whl', text)
            words = words[2:]
        assert words[:2] == ["$PY", "bench/peers_gpu.py"]
        args = peers_gpu._parser().parse_args(words[2:])
        assert args.model == name and not args.quick and args.out.startswith("/tmp/")
        outs[name] = args.out
    assert {"$rc_tt", "$rc_hf"} <= set(text.split("for r in", 1)[1].split(";")[0].split())
    fold = re.search(r'^\$PY - "\$OUT/gpu_check.json" (\S+) (\S+) <<\'PYEOF\' \|\| true\n(.*?)^PYEOF$',
                     text, re.M | re.S)
    assert fold and (fold.group(1), fold.group(2)) == (outs["torchtitan"], outs["transformers"])
    main, tt, hf = tmp_path / "gpu_check.json", tmp_path / "tt.json", tmp_path / "hf.json"
    main.write_text(json.dumps({"time.trainer_step": {"mfu": 0.25}, "time.peak_matmul": {"tflops": 700}}))
    tt.write_text(json.dumps({"step": {"skipped": "torchtitan's qwen3 model needs tyro"}}))
    subprocess.run(["python3", "-", str(main), str(tt), str(hf)], input=fold.group(3), text=True, check=True)
    peers = json.loads(main.read_text())["peers"]
    assert peers == {"ours": {"step": {"mfu": 0.25}, "peak_matmul": {"tflops": 700}},
                     "torchtitan": {"step": {"skipped": "torchtitan's qwen3 model needs tyro"}}, "transformers": None}
    assert json.loads(main.read_text())["time.trainer_step"] == {"mfu": 0.25}


def test_peers_transformers_quick_step_on_cpu_counts_the_pairs_it_computes(tmp_path):
    """transformers' Qwen3 MoE at the tiny shape on the trainer section's packed row: a timed step,
    per-document masking (packed position ids), so its FLOPs are the documents' pairs, fewer than
    the row's causal pairs a peer without a document mask would be counted for."""
    from bench import peers_gpu

    out = tmp_path / "hf.json"
    assert peers_gpu.main(["--model", "transformers", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    step = res["step"]
    assert step["tokens_per_s"] > 0 and step["mfu"] is not None and step["document_mask"] is True
    assert step["tokens"] == gpu_check.QUICK.step_tokens and step["docs"] > 1 and step["params"] == "fp32"
    cfg = peers_gpu._model_config(gpu_check.QUICK)
    lens, _ = peers_gpu._row(gpu_check.QUICK, cfg.vocab_size)
    per_doc = peers_gpu._causal_pairs_flops(cfg, lens, True)
    assert step["model_tflop_per_step"] * 1e12 == pytest.approx(per_doc)
    assert per_doc < peers_gpu._causal_pairs_flops(cfg, lens, False)
    # the same shape as ours: transformers' Qwen3 MoE holds as many parameters as our model
    from longctx_moe.model import build_model

    assert step["total_params"] == sum(p.numel() for p in build_model(cfg).parameters())


def test_peers_torchtitan_says_in_one_line_which_modules_it_lacks(tmp_path, monkeypatch, capsys):
    from bench import peers_gpu

    monkeypatch.setattr(peers_gpu, "TORCHTITAN_IMPORTS", ("torch", "no_such_module_for_the_test"))
    out = tmp_path / "tt.json"
    assert peers_gpu.main(["--model", "torchtitan", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    skipped = json.loads(out.read_text())["step"]["skipped"]
    assert "needs no_such_module_for_the_test," in skipped and "make gpu-wheels" in skipped
    assert "torch," not in skipped
    assert skipped in capsys.readouterr().out


def test_peers_torchtitan_builds_from_the_carried_wheels_and_runs_a_forward_on_cpu(tmp_path):
    """The wheels `make gpu-wheels` puts in bench/wheels, installed offline into a directory as
    gpu_check.sh does: torchtitan's Qwen3 MoE at the tiny shape, our parameter count, one forward
    of the packed row with its document mask (flex attention has no backward on CPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bench import peers_gpu

    wheels = sorted((Path(peers_gpu.__file__).parent / "wheels").glob("*.whl"))
    if not any(w.name.startswith("torchtitan-") for w in wheels):
        pytest.skip("bench/wheels holds no torchtitan wheel: `make gpu-wheels`")
    target = tmp_path / "tt"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q", "--target",
                    str(target), *map(str, wheels)], check=True)
    out = tmp_path / "tt.json"
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, peers_gpu.__file__, "--model", "torchtitan", "--quick", "--device",
                           "cpu", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    step = json.loads(out.read_text())["step"]
    assert "no backward on CPU" in step["skipped"]
    assert 7.0 < step["forward_loss"] < 9.5  # about ln(4096) = 8.3 at init
    from longctx_moe.model import build_model

    cfg = peers_gpu._model_config(gpu_check.QUICK)
    assert step["total_params"] == sum(p.numel() for p in build_model(cfg).parameters())
