"""The GPUs a rehearsal models: memory, peak dense bf16 and FP8 FLOP/s, HBM bandwidth, and the
links a collective crosses, with their sources.

Figures are the vendors' datasheet numbers for the SXM parts of HGX / DGX systems (8 GPUs per node
on NVLink/NVSwitch, one 400 Gb/s InfiniBand NDR port per GPU across nodes):
- H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense BF16 (1,979 with sparsity), 1,979 TFLOP/s
  dense FP8, NVLink 4 900 GB/s per GPU (both directions together). NVIDIA H100 Tensor Core GPU
  datasheet.
- H200 SXM: 141 GB HBM3e, 4.8 TB/s, compute as H100 (989 TFLOP/s dense BF16, 1,979 FP8), NVLink
  900 GB/s. NVIDIA H200 Tensor Core GPU datasheet.
- B200 (HGX B200): 180 GB HBM3e per GPU, 7.7 TB/s, 2.25 PFLOP/s dense BF16 (4.5 with
  sparsity), 4.5 PFLOP/s dense FP8, NVLink 5 1.8 TB/s per GPU. NVIDIA HGX B200 / DGX B200
  datasheets.
- InfiniBand NDR: 400 Gb/s = 50 GB/s per direction per GPU (ConnectX-7).
A collective's bandwidth is per direction: half the NVLink figure inside a node.

The node's host, which optim.offload=cpu uses (cost.host_optimizer_seconds):
- DGX H100 and DGX H200: 2 x Intel Xeon Platinum 8480C, 112 cores, DDR5-4800 on 8 channels a
  socket: 2 x 8 x 4.8 GT/s x 8 B = 614 GB/s of DRAM bandwidth (peak; a STREAM triad reaches
  ~75% of it), shared by the node's 8 GPUs' ranks. NVIDIA DGX H100 / H200 datasheets; Intel's
  product page for the memory channels and speed.
- DGX B200: 2 x Intel Xeon Platinum 8570, 112 cores, DDR5-5600 on 8 channels a socket: 717 GB/s.
- The GPU's link to the host: PCIe Gen5 x16 on all three, 32 GT/s x 16 lanes = 64 GB/s per
  direction raw, ~50 GB/s after the 128b/130b encoding and packet overhead. We assume 40 GB/s
  per direction per GPU in practice (pinned copies; a PCIe switch on the way shared with a NIC),
  unmeasured: bench/offload_gpu.py reports the offload's GB/s on a lent GPU.
Compute capability: 9.0 for Hopper (H100, H200), 10.0 for Blackwell (B200); CUDA's list of GPUs.

`as_cuda_device(gpu)`: for the block, torch.cuda's questions about a device's kind (compute
capability, name), which the program asks to refuse what a GPU cannot run (FP8 tensor cores, the
blockwise FP8 GEMM of Hopper), are answered for the rehearsed GPU: this process has none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # HBM capacity (what torch's allocator can reach is a little less)
    bf16_flops: float  # dense peak, FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per direction, per GPU, inside a node
    network_bytes_per_s: float = 50e9  # per direction, per GPU, across nodes (IB NDR 400 Gb/s)
    gpus_per_node: int = 8
    # one collective call's fixed cost (NCCL's launch and protocol latency inside a node, of the
    # order of nccl-tests' small-message times) and a kernel launch's host cost
    collective_latency_s: float = 20e-6
    launch_s: float = 5e-6
    capability: tuple[int, int] = (9, 0)
    fp8_flops: float = 1979e12  # dense peak of the FP8 GEMMs (torch._scaled_mm and its grouped form)
    # the node's host (module docstring): optim.offload=cpu's copies and AdamW
    host_link_bytes_per_s: float = 40e9  # per direction, per GPU (PCIe Gen5 x16, assumed in practice)
    host_memory_bytes_per_s: float = 614e9  # the node's DRAM, shared by its GPUs' ranks
    host_cores: int = 112  # the node's, shared alike


GPUS = {
    "h100": GPU("H100 SXM5 80GB", 80 * 10**9, 989e12, 3.35e12, 450e9),
    "h200": GPU("H200 SXM 141GB", 141 * 10**9, 989e12, 4.8e12, 450e9),
    "b200": GPU("B200 180GB", 180 * 10**9, 2.25e15, 7.7e12, 900e9, capability=(10, 0),
                fp8_flops=4.5e15, host_memory_bytes_per_s=717e9),
}


@contextlib.contextmanager
def as_cuda_device(gpu: GPU) -> Iterator[None]:
    """torch.cuda.get_device_capability / get_device_name answer `gpu`'s, for the block."""
    with (mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: gpu.capability),
          mock.patch.object(torch.cuda, "get_device_name", lambda device=None: gpu.name)):
        yield
