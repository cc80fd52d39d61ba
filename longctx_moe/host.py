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

Why a `lean` mode serves blocks above 1 MiB with their own mmap: the 32 MiB split is tuned for one
process holding a whole long document, whose activations are mostly above 32 MiB. A rank that
holds a quarter of the tokens (context parallelism) or a short micro-batch has most activations
between 1 and 32 MiB, so they land on the heap and fragment it the same way. Measured on a 32K-token
document (bench/long_context.py, recompute none, peak RSS): one process 5.08 GiB with the 32 MiB
split, 4.64 GiB with a 2 MiB one, 4.56 GiB with 0.5 MiB; the largest of 4 CP ranks 2.09, 1.56,
1.54 GiB. Each block above 1 MiB faults its pages in again at every allocation: one step on one
rank, alternating modes, 3 rounds, quiet machine: 4K tokens 0.71x the tokens/s of `tuned` for
0.84x its peak, 16K tokens 0.90x for 0.82x. Speed is the common case: `tuned` stays the default.

Why one arena: glibc gives threads other than the main one heaps of their own ("arenas"), which
the trim threshold above keeps from shrinking too. With two micro-batches in flight
(parallel/interleave.py) each step's forwards run in fresh threads, and every rank's peak RSS grew
by ~155 MB per step on 4 ranks (tiny_cpu.yaml, EP4, 10 steps: 616 -> 2006 MB, against 510 -> 774
MB with one micro-batch at a time); with every thread on the main heap it grew as the one-at-a-time
run did (514 -> 779 MB). Only one of those threads computes at a time, so they do not contend for
the heap's lock.

Why oneDNN's caches are capped: torch's bf16 CPU GEMMs keep two caches keyed by operand shape,
oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's (LRU_CACHE_CAPACITY), 1024
entries each by default and about 270 KB per entry in each (536 KB per new GEMM shape). Packed
micro-batches of varying lengths and the experts' padded row counts bring new shapes for hundreds of
steps: `make train` held 190 MB of malloc'd bytes at step 1 and 686 MB at step 200, when the caches
were full. A step uses 150-270 shapes (tiny_cpu.yaml; bench/train_throughput.py's model), so 512
entries keep every step's shapes: 410 MB from step 60 on, at the same tokens/s. What still grows
is heap fragmentation around those long-lived blocks (docs/PERFORMANCE.md, "Memory over a run").

Why the heap is trimmed now and then (HeapTrim): free() gives back only the top of the heap, and
only an mmapped block's pages leave the process when it is freed. A step's blocks of 128 KiB-32
MiB land wherever the heap has a hole that fits, between the caches' long-lived entries; with
new lengths every step they land in new places, and every page a step ever touched stays
resident. The peak resident set therefore creeps up for hundreds of steps although the live
bytes do not (make train, 300 steps: median peak 1.36 GB over steps 101-200, 1.49 GB over
201-300). glibc's malloc_trim(0) hands the free pages inside the heap back (madvise), at the cost
of faulting them in again on the next step: trimming after every step ran at about half the
tokens/s. Trimming only when the resident set after a step has grown by more than a fraction
(train.host_heap_trim, 0.1) held that run's median peak at 1.05 GB from step 60 on, for ~3% of
the step time (docs/PERFORMANCE.md, "Memory over a run").

Whose process it is (train.host_tuning): every setting above is process-wide. `longctx-moe train`
and the benchmarks own their processes and tune them (`auto`). A PolicyTrainer runs inside a
process an RL framework made (a verl engine, a NeMo-RL worker, a Ray actor), whose other code
(rollout engines, the framework's own tensors, its thread pools) would inherit them: there `auto`
changes nothing the config does not name (an explicit train.num_threads or train.host_allocator
tuned / lean), and train.host_tuning=full asks for the whole tuning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from dataclasses import dataclass

import torch

from longctx_moe.choices import check_choice

# glibc <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# auto: tuned where the host is tuned (train.host_tuning), glibc's settings left alone elsewhere.
ALLOCATOR_MODES = ("auto", "tuned", "lean", "default")
# auto: full in a process of ours (`longctx-moe train`), none in one an RL framework made.
HOST_TUNING = ("auto", "full", "none")

# Smallest block glibc serves with its own mmap, by allocator mode (see the module docstring).
MMAP_THRESHOLD = {"tuned": 32 << 20, "lean": 1 << 20}

# GEMM shapes kept by each of oneDNN's primitive cache and ideep's cache (see the module docstring).
ONEDNN_CACHE_CAPACITY = 512
ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


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


def resident_mb() -> float | None:
    """This process's resident set now, in MiB (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class HeapTrim:
    """Trims the heap (malloc_trim) after a step whose resident set exceeds the reference by more
    than `slack` (a fraction; see the module docstring). The reference is the resident set after
    the first step and after the first step that follows each trim: that step faults its working
    set back in, so measuring right after the trim would trim again at every step. `slack` 0
    never trims; neither does a process without glibc or /proc."""

    def __init__(self, slack: float):
        if slack < 0:
            raise ValueError(f"heap trim slack must be >= 0 (0 = never trim), got {slack}")
        self.slack = slack
        self.reference_mb: float | None = None
        self.enabled = slack > 0 and _libc() is not None and resident_mb() is not None

    def after_step(self) -> bool:
        """Call when a step's activations are freed; True when it trimmed."""
        if not self.enabled:
            return False
        now = resident_mb()
        if self.reference_mb is None:
            self.reference_mb = now
            return False
        if now <= self.reference_mb * (1 + self.slack):
            return False
        _libc().malloc_trim(0)
        self.reference_mb = None
        return True


def _mallopt(param: int, value: int) -> bool:
    """glibc's mallopt: every malloc setting of the project goes through here (a test watches it
    to see that a process we do not own was left alone)."""
    return bool(_libc().mallopt(param, value))


def tune_host_allocator(mode: str = "tuned") -> bool:
    """Keep freed heap memory for reuse, blocks above MMAP_THRESHOLD[mode] in their own mmap (see
    the module docstring). Returns False where the C library has no glibc mallopt, in which case
    nothing changes. Idempotent."""
    if _libc() is None:
        return False
    # Smaller blocks from the heap, where their freed pages stay mapped. Setting the threshold
    # also stops glibc from moving it itself.
    ok = _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD[mode])
    ok &= _mallopt(_M_TRIM_THRESHOLD, 1 << 30)  # give memory back only past 1 GiB of free top
    ok &= _mallopt(_M_TOP_PAD, 64 << 20)  # grow the heap in 64 MiB steps, not per allocation
    ok &= _mallopt(_M_ARENA_MAX, 1)  # every thread on that one heap (module docstring)
    return ok


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> list[str]:
    """Cap oneDNN's and ideep's GEMM caches at `capacity` shapes each (see the module docstring),
    unless the environment already sets them; returns the variables it set. Each library reads
    its variable once, at the process's first bf16 GEMM: this must run before it (the trainer's
    start-up does, before the model is built); later it changes nothing in this process."""
    if capacity < 1:  # ideep crashes on LRU_CACHE_CAPACITY=0
        raise ValueError(f"oneDNN cache capacity must be >= 1, got {capacity}")
    unset = [var for var in ONEDNN_CACHE_VARS if var not in os.environ]
    os.environ.update({var: str(capacity) for var in unset})
    return unset


@dataclass(frozen=True)
class HostSettings:
    """The process-wide settings to make; None / False leaves that part of the process as found."""

    threads: int | None = None  # torch's intra-op threads
    # Denormal fp32 values (AdamW's second moments of tiny gradients) make sqrt/div crawl on x86.
    flush_denormals: bool = False
    allocator: str | None = None  # a key of MMAP_THRESHOLD: tune glibc malloc
    onednn_cache: int | None = None  # capacity for ONEDNN_CACHE_VARS the environment leaves unset
    reason: str = ""  # why: printed with what was set


def host_settings(tuning: str, num_threads: int, allocator: str, *, owned: bool,
                  default_threads: int) -> HostSettings:
    """What to change in this process (see "Whose process it is" above). `owned`: the process is
    ours (`longctx-moe train`'s ranks); `default_threads`: the thread count of a tuned host whose
    train.num_threads is 0."""
    check_choice("train.host_tuning", tuning, HOST_TUNING)
    check_choice("train.host_allocator", allocator, ALLOCATOR_MODES)
    if num_threads < 0:
        raise ValueError(f"train.num_threads={num_threads} must be >= 0 (0 = automatic)")
    if tuning == "full" or (tuning == "auto" and owned):
        why = ("train.host_tuning=auto: `longctx-moe train` tunes its own process" if tuning == "auto"
               else "train.host_tuning=full")
        mode = "tuned" if allocator == "auto" else allocator
        return HostSettings(num_threads or default_threads, True, mode if mode in MMAP_THRESHOLD else None,
                            ONEDNN_CACHE_CAPACITY, why)
    # A process we do not own (or host_tuning=none): only what the config names explicitly.
    mode = allocator if allocator in MMAP_THRESHOLD else None
    asked = [key for key, given in (("train.num_threads", num_threads > 0), ("train.host_allocator", mode))
             if given]
    return HostSettings(num_threads or None, False, mode, None,
                        f"set explicitly by {' and '.join(asked)}; train.host_tuning={tuning} leaves the rest "
                        "of this process as it was")


def apply_host(settings: HostSettings) -> str | None:
    """Make `settings`' changes to this process; one line saying what was set (None: nothing)."""
    done = []
    if settings.threads:
        torch.set_num_threads(settings.threads)
        done.append(f"{settings.threads} intra-op thread{'s' if settings.threads > 1 else ''}")
    if settings.flush_denormals and torch.set_flush_denormal(True):  # False: no FTZ/DAZ on this CPU
        done.append("denormals flushed to zero")
    if settings.allocator and tune_host_allocator(settings.allocator):
        done.append(f"glibc malloc {settings.allocator} (mmap above "
                    f"{MMAP_THRESHOLD[settings.allocator] >> 20} MiB, trim above 1 GiB, one arena)")
    if settings.onednn_cache:
        done += [f"{var}={settings.onednn_cache}" for var in bound_onednn_caches(settings.onednn_cache)]
    return f"host: {', '.join(done)} ({settings.reason})" if done else None


def configure_cpu(threads: int, allocator: str = "tuned") -> str | None:
    """Tune a process of ours (the benchmarks'): flush denormals, set the intra-op thread count
    (threads > 0), cap oneDNN's shape caches, and (allocator 'tuned', 'lean' or 'auto') tune
    malloc. Returns the line saying what was set."""
    return apply_host(host_settings("full", max(threads, 0), allocator, owned=True, default_threads=0))
