"""What a CUDA device has and torch refuses to `meta` tensors although the ops run on them: the
foreach kernels and the fused optimizer kernels. torch asks a device list before it takes either
path (clip_grad_norm_ with foreach=True raises "can't use the foreach API on meta tensors"; AdamW
with fused=True refuses a device off its list, and optim.py's "auto" takes foreach there); within
`cuda_kernels()` meta is on both lists, as CUDA is, so the program's foreach calls and its fused
AdamW run as on the GPU it stands for. An optimizer picks its kernels when it is built: build it
inside the block too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

# torch.optim.optimizer imports the lists by name, so each is patched there as well
_LISTS = ("_get_foreach_kernels_supported_devices", "_get_fused_kernels_supported_devices")


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    with contextlib.ExitStack() as stack:
        for name in _LISTS:
            listed = getattr(_foreach_utils, name)
            with_meta = lambda listed=listed: [*listed(), "meta"]  # noqa: E731
            for module in (_foreach_utils, optimizer):
                stack.enter_context(mock.patch.object(module, name, with_meta))
        yield
