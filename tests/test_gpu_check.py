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
    timeouts within one device call's 600 s."""
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
    assert sum(int(s) for s in re.findall(r"^\s*section \S+ (\d+) ", text, re.M)) <= 600
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
