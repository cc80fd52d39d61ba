"""optim.impl=auto picks torch AdamW's implementation by torch's own list of devices with fused
optimizer kernels: fused for contiguous tensors on a listed device (CPU here, CUDA on a GPU),
foreach for strided ones (the distributed optimizer's slabs) and for a device off the list."""

from __future__ import annotations

from unittest import mock

import torch
from torch.utils import _foreach_utils

from longctx_moe.config import OptimConfig
from longctx_moe.optim import _impl_kwargs, build_adamw


def _params(device: str = "cpu") -> list[torch.Tensor]:
    return [torch.nn.Parameter(torch.zeros(4, 4, device=device)), torch.nn.Parameter(torch.zeros(4, device=device))]


def test_auto_is_fused_on_cpu_and_foreach_for_strided_tensors():
    assert _impl_kwargs("auto", _params()) == {"fused": True}
    strided = torch.zeros(4, 8)[:, ::2]
    assert _impl_kwargs("auto", [strided]) == {"foreach": True}
    assert build_adamw(_params(), OptimConfig()).defaults["fused"] is True


def test_auto_follows_torchs_list_of_fused_devices():
    """A device torch does not list (meta) takes foreach; listing it makes auto fused, and taking
    CPU off the list makes CPU foreach (a hard-coded set would answer the same either way)."""
    assert _impl_kwargs("auto", _params("meta")) == {"foreach": True}
    listed = _foreach_utils._get_fused_kernels_supported_devices
    with mock.patch.object(_foreach_utils, "_get_fused_kernels_supported_devices", lambda: [*listed(), "meta"]):
        assert _impl_kwargs("auto", _params("meta")) == {"fused": True}
    without_cpu = lambda: [d for d in listed() if d != "cpu"]  # noqa: E731
    with mock.patch.object(_foreach_utils, "_get_fused_kernels_supported_devices", without_cpu):
        assert _impl_kwargs("auto", _params()) == {"foreach": True}


def test_named_implementations_are_taken_as_given():
    assert _impl_kwargs("fused", _params("meta")) == {"fused": True}
    assert _impl_kwargs("foreach", _params()) == {"foreach": True}
    assert _impl_kwargs("for_loop", _params()) == {"foreach": False}
