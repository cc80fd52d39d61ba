"""What a CUDA device has and torch refuses to `meta` tensors although the ops run on them: the
foreach kernels. torch asks a device list before it takes that path (clip_grad_norm_ with
foreach=True raises "can't use the foreach API on meta tensors"); within `cuda_kernels()` meta
is on it, as CUDA is, so the program's foreach calls run as on the GPU it stands for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    from torch.utils import _foreach_utils

    devices = _foreach_utils._get_foreach_kernels_supported_devices
    with mock.patch.object(_foreach_utils, "_get_foreach_kernels_supported_devices",
                           lambda: [*devices(), "meta"]):
        yield
