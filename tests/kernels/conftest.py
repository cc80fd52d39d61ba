"""The Triton kernels run here under Triton's interpreter (numpy on CPU tensors), switched on by
tests/conftest.py before any module imports triton. With a CUDA device the tests still use CPU
tensors and the interpreter; the compiled kernels are checked by bench/gpu_check.sh."""

import pytest


@pytest.fixture
def launches(monkeypatch):
    """A list that gets one entry per Triton kernel launch (fn[grid] is every launch's path)."""
    import triton.runtime.jit

    seen = []
    getitem = triton.runtime.jit.KernelInterface.__getitem__

    def counted(self, grid):
        seen.append(self)
        return getitem(self, grid)

    monkeypatch.setattr(triton.runtime.jit.KernelInterface, "__getitem__", counted)
    return seen
