"""A "cpu" platform for verl, so its TrainingWorker runs on a machine without an accelerator.

verl 0.9.1 registers only GPU / NPU platforms (verl/plugin/platform) and falls back to "nvidia"
when none is present, after which its worker puts every tensor on "cuda". This module registers a
host platform in verl's PlatformRegistry; verl loads it at `import verl` through our "verl.plugins"
entry point (pyproject.toml), and its auto-detection picks it only when no accelerator platform is
available (the registered GPU platforms are probed first). VERL_PLATFORM=cpu forces it.

Memory figures are the process's peak resident set (there is no allocator to ask on the host).
It registers no engine: the longctx_moe engine comes through `model.external_lib`.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from types import SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _peak_rss_bytes(*_: Any) -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# The torch.cuda-like calls verl's worker makes on get_torch_device().
HOST = SimpleNamespace(
    max_memory_allocated=_peak_rss_bytes, max_memory_reserved=_peak_rss_bytes,
    memory_allocated=_peak_rss_bytes, memory_reserved=_peak_rss_bytes,
    mem_get_info=lambda *_: (0, 0), reset_peak_memory_stats=lambda *_: None,
    empty_cache=lambda: None, synchronize=lambda *_: None, is_available=lambda: True,
    device_count=lambda: 1, current_device=lambda: 0, set_device=lambda *_: None,
    get_device_name=lambda *_: "CPU",  # the name verl's flops_counter gives torch.cpu
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """The host: device "cpu", gloo collectives, no IPC, no profiler ranges."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return HOST

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return not torch.cuda.is_available()

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
