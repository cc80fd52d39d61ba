"""The life cycle of the native extension (cp_attention/native.py), which holds every C++ CPU
kernel: one build, one self-check per kernel (a broken kernel is reported by name, the others
still run), a first use inside a model's bf16 autocast region (where a self-check that was itself
autocast once failed on a dtype mismatch and switched the kernel off), a failed build (one
warning), the `disabled()` block, a build directory holding the lock file of a build that was
killed half-way, and the cache key a fresh clone shares."""

from __future__ import annotations

import shutil
import threading
import warnings

import pytest
import torch

from cp_attention import native, native_checks
from cp_attention.hardware import cpu_has_avx512_bf16

KERNELS = list(native.KERNELS)
needs_cpu = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="no AVX512-BF16 here: the kernels are not built")


@pytest.fixture
def fresh(monkeypatch):
    """A process that has asked nothing yet (the build itself stays cached on disk)."""
    monkeypatch.setattr(native, "_STATE", native._State())


@needs_cpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_built_and_self_checked_where_the_cpu_can_run_it(kernel, fresh):
    """A build or self-check failure falls back to torch with a warning at run time; in the tests
    it is a failure, so that a broken kernel is not mistaken for a CPU without AVX512-BF16."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.unavailable_reason(kernel) is None


@needs_cpu
def test_one_module_serves_every_kernel(fresh):
    mod = native.extension()
    assert mod.__name__ == native.EXTENSION.name
    for entry in ("varlen_causal_forward", "varlen_causal_backward", "forward_stats", "backward_grad_",
                  "rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward"):
        assert callable(getattr(mod, entry))
    assert set(native_checks.CHECKS) == set(native.KERNELS)


@pytest.mark.parametrize("kernel", KERNELS)
def test_first_use_inside_autocast_still_builds_and_runs(kernel, fresh):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning fails the test
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reason = native.unavailable_reason(kernel)
    if reason is not None:
        assert not cpu_has_avx512_bf16(), reason
        pytest.skip(f"not built here: {reason}")


def test_without_the_instructions_nothing_is_built_and_the_reason_says_so(fresh, monkeypatch):
    monkeypatch.setattr(native, "cpu_has_avx512_bf16", lambda: False)
    monkeypatch.setattr(native.EXTENSION, "build", lambda: pytest.fail("built on a CPU that cannot run it"))
    for kernel in KERNELS:
        reason = native.unavailable_reason(kernel)
        assert reason and ("bf16" in reason.lower() or "avx512" in reason.lower()), reason
    with pytest.raises(RuntimeError, match="cannot run here"):
        native.kernel("swiglu")


def test_a_failed_build_warns_once_and_every_kernel_names_its_cause(fresh, monkeypatch):
    def no_compiler():
        raise OSError("no C++ compiler")

    monkeypatch.setattr(native, "_platform_reason", lambda: None)
    monkeypatch.setattr(native.EXTENSION, "build", no_compiler)
    with pytest.warns(UserWarning) as caught:
        reasons = [native.unavailable_reason(k) for k in KERNELS]
    assert len(caught) == 1 and "did not build" in str(caught[0].message) and "ninja" in str(caught[0].message)
    assert all("no C++ compiler" in r for r in reasons), reasons


@needs_cpu
def test_a_failing_self_check_is_reported_by_name_and_leaves_the_others(fresh, monkeypatch):
    def wrong(mod):
        raise RuntimeError("self-check against float64 maths failed")

    monkeypatch.setitem(native_checks.CHECKS, "rmsnorm", wrong)
    with pytest.warns(UserWarning, match="fused CPU RMSNorm unavailable.*self-check"):
        assert "self-check" in native.unavailable_reason("rmsnorm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.unavailable_reason("swiglu") is None


def test_disabled_turns_kernels_off_for_the_block_only(fresh):
    before = {k: native.unavailable_reason(k) for k in KERNELS}
    with native.disabled("swiglu"):
        assert "disabled" in native.unavailable_reason("swiglu")
        assert {k: native.unavailable_reason(k) for k in KERNELS if k != "swiglu"} == \
            {k: r for k, r in before.items() if k != "swiglu"}
        with native.disabled():  # all of them, nested
            assert all(native.unavailable_reason(k) for k in KERNELS)
        assert native.unavailable_reason("rmsnorm") == before["rmsnorm"]
    assert {k: native.unavailable_reason(k) for k in KERNELS} == before


def test_an_unknown_kernel_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown native kernel 'gelu'.*swiglu"):
        native.unavailable_reason("gelu")
    with pytest.raises(ValueError, match="unknown native kernel"):
        with native.disabled("gelu"):
            pass


@needs_cpu
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(fresh):
    """torch's build lock is a plain file: a build killed mid-compile leaves it, and torch's
    load() then waits on it forever. The build takes an flock first and removes such a file."""
    build_dir = native.EXTENSION.build_dir
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").touch()
    worker = threading.Thread(target=native.unavailable_reason, args=("swiglu",), daemon=True)
    worker.start()
    worker.join(timeout=600)  # a cold compile takes ~1 min here; the stale lock alone waits forever
    assert not worker.is_alive(), "the build waited on the stale lock file"
    assert not (build_dir / "lock").exists()


def test_build_key_covers_every_source_and_header_not_the_checkout(tmp_path):
    """Two clones (or venvs) with the same torch and the same sources share one built extension;
    a change to any .cpp or .h of the folder (content, name, a file added) gets its own entry."""
    copy = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(native.SOURCE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    key = native.build_key(native.SOURCE_DIR)
    assert native.build_key(copy) == key and native.EXTENSION.name.endswith(key)
    header = copy / "common.h"
    header.write_bytes(header.read_bytes() + b"\n// changed\n")
    assert native.build_key(copy) != key
    shutil.copy(native.SOURCE_DIR / "common.h", header)
    assert native.build_key(copy) == key
    (copy / "extra.cpp").write_text("// a new kernel family\n")
    assert native.build_key(copy) != key
    (copy / "extra.cpp").unlink()
    (copy / "swiglu.cpp").rename(copy / "swiglu2.cpp")
    assert native.build_key(copy) != key
