"""The host memory of the rehearsed node: what the program allocates there for the optimizer
(optim.offload=cpu) takes no memory of this machine.

A rank of Mixtral-8x22B on 32 GPUs keeps some 70 GB of masters, moments and gradient buffers in
its node's host memory with optim.offload=cpu; the rehearsal runs that rank on one CPU. Within
`host_memory()` the program's one allocator of that memory (optim_offload.host_empty) returns
fake host tensors (torch's FakeTensor on `cpu`: shapes, dtypes and storage sizes, no bytes), so
the copies from and to the device and the host AdamW run as ops without values, and the memory
tracker counts the tensors as host bytes (RankReport.host_bytes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longctx_moe import optim_offload

    # the device tensors copied in and out are meta: real tensors to a fake op
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def host_empty(shape, dtype, pin):
        with mode:
            return torch.empty(shape, dtype=dtype, device="cpu")

    with mock.patch.object(optim_offload, "host_empty", host_empty):
        yield
