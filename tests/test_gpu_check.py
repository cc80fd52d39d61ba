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
