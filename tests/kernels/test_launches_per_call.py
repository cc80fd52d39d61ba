"""kernels.LAUNCHES_PER_CALL against the operators' bodies: the step's counts (rehearsal/counts.py)
see an operator once, through its fake implementation, and take its launches from that table.
Here each listed operator's implementation runs on CPU tensors under the interpreter, its Triton
launches and its torch ops that would launch on a device (fills, reductions) counted, with the
inputs of the GPU step's case."""

from __future__ import annotations

import pytest
import torch

from longctx_moe.kernels import LAUNCHES_PER_CALL, triton_ops
from longctx_moe.rehearsal.counts import OpCounts
from tests.kernels.test_triton_meta import _balance, _randn

pytestmark = pytest.mark.triton


def _cases() -> dict:
    """name -> (operator module attribute, args) in the step's case."""
    L = torch.ops.longctx
    x, w = _randn(9, 32, grad=False), _randn(32, seed=1, grad=False)
    _, r_N = L.rmsnorm_fwd(x, w, 1e-6, torch.float32)
    s, z, idx, doc, n, aux_c, z_c = _balance()[1]
    return {
        "longctx.rmsnorm_bwd": ("rmsnorm", "rmsnorm_bwd", (_randn(9, 32, grad=False), None, x, w, r_N)),
        "longctx.add_rmsnorm_bwd": ("rmsnorm", "add_rmsnorm_bwd", (_randn(9, 32, grad=False), _randn(9, 32, grad=False),
                                                                x, w, r_N, torch.bfloat16)),
        "longctx.balance_fwd": ("balance", "balance_fwd", (s.detach(), z.detach(), idx, doc, n, aux_c, z_c)),
        "longctx.route_layout": ("layout", "route_layout_op", (idx, 12)),
    }


@pytest.fixture
def kernel_launches(monkeypatch):
    """A list with one entry per Triton launch; the interpreter's own tensor work inside a
    launch runs with the counting mode off (it is the kernel, counted once here)."""
    import triton.runtime.jit
    from torch.utils._python_dispatch import _disable_current_modes

    seen = []
    getitem = triton.runtime.jit.KernelInterface.__getitem__

    def counted(self, grid):
        launch = getitem(self, grid)

        def run(*args, **kwargs):
            seen.append(self)
            with _disable_current_modes():
                return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(triton.runtime.jit.KernelInterface, "__getitem__", counted)
    return seen


@pytest.mark.parametrize("name", sorted(LAUNCHES_PER_CALL))
def test_table_counts_the_operator_body(name, kernel_launches):
    import importlib

    triton_ops()
    module, attr, args = _cases()[name]
    op = getattr(importlib.import_module(f"longctx_moe.kernels.triton_{module}"), attr)
    kernel_launches.clear()
    with OpCounts(device="cpu") as counts:
        op._init_fn(*args)
    body = counts.report()
    assert len(kernel_launches) + body["launches_per_step"] == LAUNCHES_PER_CALL[name], \
        (len(kernel_launches), {k: v for k, v in body["by_op"].items() if v["launches"]})


def test_every_listed_operator_has_a_case():
    assert set(_cases()) == set(LAUNCHES_PER_CALL)
