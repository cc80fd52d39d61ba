"""The life cycle both C++ attention kernels share (cp_attention/kernels/_cpp_kernel.py): the
environment switch, and a first use inside a model's bf16 autocast region (where a self-check
that was itself autocast once failed on a dtype mismatch and switched the kernel off)."""

from __future__ import annotations

import warnings

import pytest
import torch

from cp_attention.kernels import amx_backward, brgemm_forward

ADAPTERS = [pytest.param(brgemm_forward, id="forward"), pytest.param(amx_backward, id="backward")]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_switched_off_by_environment(adapter, monkeypatch):
    monkeypatch.setattr(adapter.KERNEL, "state", {})
    monkeypatch.setenv(adapter.KERNEL.env, "0")
    assert not adapter.available()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_first_use_inside_autocast_still_builds_and_runs(adapter, monkeypatch):
    monkeypatch.setattr(adapter.KERNEL, "state", {})  # a first use: built and self-checked anew
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning fails the test
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if not adapter.available():
                pytest.skip("no AVX512-BF16 here, or no compiler: the kernel is not built")
