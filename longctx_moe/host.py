"""Process-level CPU settings the trainer applies at start-up (and the benchmarks apply the same way).

Why the allocator matters on CPU: torch's CPU tensors come from glibc malloc, which serves blocks
above 128 KiB-32 MiB with fresh mmap() calls and returns them on free. A training step allocates
and frees the same few hundred MB of activations every micro-batch, so every step pays a page
fault (and a page zeroing) for every 4 KiB it touches: ~210k faults and about a fifth of the step
time in `bench/train_throughput.py` on our 2-core Xeon. Keeping freed memory in the heap (no
trimming, blocks up to 32 MiB never mmapped) makes later steps reuse warm pages. This is the same
effect that jemalloc/tcmalloc via LD_PRELOAD give, done in-process so that `longctx-moe train`
needs no launcher tricks.

Why blocks above 32 MiB still get their own mmap: at long context most activations are that
large, and a heap that keeps them fragments: a freed 200 MB block between live ones cannot hold
the next 250 MB one, so the heap grows past the step's live bytes. Measured on a 16K-token
document (bench/long_context.py's model, full recompute): the heap for every block took 3.12 GiB
of peak RSS, this split 2.68 GiB, plain glibc 2.49 GiB; at 2K tokens the split keeps most of the
speed (CPU seconds per step 0.97 all-heap, 1.01 split, 1.06 plain glibc). A fault per 4 KiB of a
block that large costs little next to the arithmetic done on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

from longctx_moe.choices import check_choice

# glibc <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

ALLOCATOR_MODES = ("tuned", "default")


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        lib.mallopt  # noqa: B018 - absent on musl and other non-glibc C libraries
    except (OSError, AttributeError):
        return None
    return lib


def tune_host_allocator() -> bool:
    """Keep freed heap memory for reuse (see the module docstring). Returns False where the C
    library has no glibc mallopt, in which case nothing changes. Idempotent."""
    lib = _libc()
    if lib is None:
        return False
    # Blocks up to 32 MiB (glibc's largest threshold) from the heap: their freed pages stay mapped.
    # Setting it also stops glibc from moving the threshold itself.
    ok = lib.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    ok &= lib.mallopt(_M_TRIM_THRESHOLD, 1 << 30)  # give memory back only past 1 GiB of free top
    ok &= lib.mallopt(_M_TOP_PAD, 64 << 20)  # grow the heap in 64 MiB steps, not per allocation
    return bool(ok)


def configure_cpu(threads: int, allocator: str = "tuned") -> None:
    """Flush denormals, set the intra-op thread count, and (allocator='tuned') tune malloc."""
    check_choice("train.host_allocator", allocator, ALLOCATOR_MODES)
    # Denormal fp32 values (AdamW's second moments of tiny gradients) make sqrt/div crawl on x86.
    torch.set_flush_denormal(True)
    if threads > 0:
        torch.set_num_threads(threads)
    if allocator == "tuned":
        tune_host_allocator()
