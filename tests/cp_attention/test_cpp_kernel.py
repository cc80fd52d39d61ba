"""The life cycle both C++ attention kernels share (cp_attention/kernels/_cpp_kernel.py): the
environment switch, a first use inside a model's bf16 autocast region (where a self-check
that was itself autocast once failed on a dtype mismatch and switched the kernel off), and a build
directory holding the lock file of a build that was killed half-way; the cache key a fresh clone
shares."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from cp_attention.hardware import cpu_has_avx512_bf16
from cp_attention.kernels import amx_backward, brgemm_forward

ADAPTERS = [pytest.param(brgemm_forward, id="forward"), pytest.param(amx_backward, id="backward")]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_switched_off_by_environment(adapter, monkeypatch):
    monkeypatch.setattr(adapter.KERNEL, "state", {})
    monkeypatch.setenv(adapter.KERNEL.env, "0")
    assert not adapter.available()


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="no AVX512-BF16 here: the kernels are not built")
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_built_and_self_checked_where_the_cpu_can_run_it(adapter, monkeypatch):
    """A build or self-check failure falls back to aten with a warning at run time; in the tests
    it is a failure, so that a broken kernel is not mistaken for a CPU without AVX512-BF16."""
    monkeypatch.delenv(adapter.KERNEL.env, raising=False)
    monkeypatch.setattr(adapter.KERNEL, "state", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adapter.available()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_first_use_inside_autocast_still_builds_and_runs(adapter, monkeypatch):
    monkeypatch.setattr(adapter.KERNEL, "state", {})  # a first use: built and self-checked anew
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning fails the test
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if not adapter.available():
                pytest.skip("no AVX512-BF16 here, or no compiler: the kernel is not built")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(adapter, monkeypatch):
    """torch's build lock is a plain file: a build killed mid-compile leaves it, and torch's
    load() then waits on it forever. The build takes an flock first and removes such a file."""
    if not cpu_has_avx512_bf16():
        pytest.skip("no AVX512-BF16 here: the kernel is never built")
    monkeypatch.setattr(adapter.KERNEL, "state", {})
    build_dir = adapter.KERNEL.build_dir
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").touch()
    worker = threading.Thread(target=adapter.available, daemon=True)
    worker.start()
    worker.join(timeout=600)  # a compile takes ~30 s here; the stale lock alone waits forever
    assert not worker.is_alive(), "the build waited on the stale lock file"
    assert not (build_dir / "lock").exists()


def test_build_key_follows_the_source_not_the_checkout(tmp_path):
    """Two clones (or venvs) with the same torch and the same source share one built kernel;
    a changed source gets its own cache entry."""
    from cp_attention.kernels._cpp_kernel import build_key

    source = brgemm_forward.KERNEL.source
    copy = tmp_path / "elsewhere" / source.name
    copy.parent.mkdir()
    copy.write_bytes(source.read_bytes())
    assert build_key(copy) == build_key(source)
    copy.write_bytes(source.read_bytes() + b"\n// changed\n")
    assert build_key(copy) != build_key(source)
    assert brgemm_forward.KERNEL.name.endswith(build_key(source))
