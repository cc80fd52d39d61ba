"""The compute dtype follows what the device does natively: bf16 where the CPU has AVX512-BF16 or
AMX, float32 on an AVX2-only CPU (where bf16 matmuls run 20-30x slower); the AVX2 emulation
switch; the MFU peak measured in the run's dtype without touching the global RNG; and a short
training run under the AVX2 emulation."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cp_attention import hardware
from longctx_moe import precision
from longctx_moe.metrics import measure_peak_tflops
from longctx_moe.model.experts import GroupedExperts

ROOT = Path(__file__).resolve().parents[2]
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.fixture
def cpu_isa(monkeypatch):
    """Answer aten's capability as `value` (None: the real one) for one test; the cached probe is
    asked anew before and after."""
    real = hardware.aten_capability

    def set_isa(value: str | None):
        monkeypatch.setattr(hardware, "aten_capability", real if value is None else (lambda: value))
        hardware._native_cpu_bf16.cache_clear()
    yield set_isa
    monkeypatch.setattr(hardware, "aten_capability", real)
    hardware._native_cpu_bf16.cache_clear()


@pytest.mark.skipif("avx512_bf16" not in hardware._cpuinfo_flags(), reason="an AVX512-BF16 CPU capped at AVX2")
def test_aten_capped_at_avx2_turns_off_native_bf16_and_the_cpp_kernels(cpu_isa):
    cpu_isa("AVX2")
    native, why = hardware.native_bf16("cpu")
    assert not native and "AVX2 build" in why
    assert not hardware.cpu_has_avx512_bf16()


def test_native_bf16_agrees_with_onednn(cpu_isa):
    cpu_isa(None)
    native, _ = hardware.native_bf16("cpu")
    assert native == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("native", [True, False])
def test_auto_picks_bf16_only_where_native(native, monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: (native, "because"))
    c = precision.resolve_compute_dtype("auto", torch.float32, "cpu")
    assert c.dtype == (torch.bfloat16 if native else torch.float32)
    assert c.autocast == (torch.bfloat16 if native else None) and not c.slow
    assert c.describe() == f"compute dtype: {'bf16' if native else 'fp32'} (train.autocast_dtype=auto: because)"


def test_auto_with_float64_parameters_computes_in_float64(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: (True, "native"))
    c = precision.resolve_compute_dtype("auto", torch.float64, "cpu")
    assert c.autocast is None and c.dtype == torch.float64


def test_explicit_bf16_without_native_bf16_runs_with_a_warning(monkeypatch, capsys):
    monkeypatch.setattr(precision, "native_bf16", lambda device: (False, "no AVX512-BF16"))
    c = precision.resolve_compute_dtype("bf16", torch.float32, "cpu")
    assert c.autocast == torch.bfloat16 and c.slow
    precision.announce(c, rank=0)
    out, err = capsys.readouterr()
    assert out.startswith("compute dtype: bf16 (train.autocast_dtype=bf16: as configured, although no AVX512-BF16")
    assert len(err.splitlines()) == 1 and err.startswith("warning: train.autocast_dtype=bf16 is emulated")
    precision.announce(c, rank=1)
    assert capsys.readouterr() == ("", "")  # once per run: rank 0 only


def test_none_never_autocasts():
    c = precision.resolve_compute_dtype("none", torch.float32, "cpu")
    assert c.autocast is None and c.name == "fp32"
    with c.context("cpu"):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_expert_precision_follows_native_bf16(native, monkeypatch):
    """Under an explicit bf16 autocast, `expert_precision: auto` runs the experts in bf16 only
    where bf16 is native; `autocast` obeys the autocast dtype everywhere."""
    import cp_attention.hardware as hardware
    from longctx_moe.execution import ExecutionConfig, Target, resolve

    monkeypatch.setattr(hardware, "native_bf16", lambda device: (native, ""))
    bf16 = Target("cpu", torch.bfloat16, torch.float32)
    x = torch.randn(5, 16)
    for setting, want in (("auto", torch.bfloat16 if native else torch.float32), ("autocast", torch.bfloat16)):
        ops = resolve(ExecutionConfig(expert_precision=setting, kernels="torch"), bf16)
        experts = GroupedExperts(4, 16, 8, ops=ops)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert experts.compute_dtype(x) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_measurement_is_quick_and_leaves_the_rng_alone(dtype):
    before = torch.get_rng_state()
    tflops = measure_peak_tflops(torch.device("cpu"), dtype, target_s=0.005, max_size=512)
    assert tflops > 0
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.slow  # a subprocess
def test_short_run_under_avx2_emulation_computes_in_float32(tmp_path, corpus):
    """Three steps of the default config with oneDNN and aten capped at AVX2 and our probes
    switched: the run says it computes in float32 and why, and trains."""
    sets = ["train.steps=3", "data.global_batch_tokens=1024", "data.micro_batch_tokens=512",
            "logging.progress_bar=false", "checkpoint.save_final=false", f"train.run_dir={tmp_path / 'run'}",
            f"data.path={corpus}"]
    cmd = [sys.executable, "-m", "longctx_moe.train", "--config", str(ROOT / "configs/tiny_cpu.yaml")]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, **AVX2_ENV}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compute dtype: fp32 (train.autocast_dtype=auto: aten's CPU kernels run the AVX2 build" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # MFU against a peak measured on this shared machine: above 0, not bounded by 1 under load.
    assert all(r["loss"] > 0 and r["mfu"] > 0 for r in records)
