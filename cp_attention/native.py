"""The project's C++ CPU kernels: one extension, built on first use, and the answer to "can this
kernel run here".

The sources are the folder `cp_attention/csrc/` (common.h: what every kernel shares; one .cpp
per kernel family; bindings.cpp: the Python module). torch.utils.cpp_extension compiles the
whole folder into one module the first time a kernel is asked for, and caches it on disk under a
key of everything the binary depends on (`build_key`). It is built only where the kernels can
run: Linux on x86-64 with AVX512-BF16 (AMX included) that oneDNN uses (cp_attention.hardware,
whose AVX2 emulation switches them off too).

    unavailable_reason(kernel) -> None where `kernel` is built and self-checked on this CPU, else
                                  why not (in words, for the start-up report)
    kernel(name)               -> the extension, for an adapter's entry points
    disable(kernel, error)     -> a kernel whose call failed is off for the process (one warning)
    disabled(*kernels)         -> a context: the torch path for the block (tests and benchmarks
                                  compare the two in one process)

Kernels (KERNELS): attention_fwd and attention_bwd (adapters cp_attention.kernels.brgemm_forward
and amx_backward), logprobs, rmsnorm and swiglu (longctx_moe.kernels.cpu_*). Each has its own
self-check against float32/64 maths (cp_attention.native_checks), run once, the first time it is
asked for: a broken kernel is reported by name and the others still run. Whether a kernel that
can run is used is the caller's choice (the execution settings); this module does not decide it.
A build that fails (no compiler, no ninja, another torch's headers) warns once and every kernel
is unavailable, with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import signal
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

from cp_attention.hardware import cpu_has_avx512_bf16, native_bf16
from cp_attention.native_checks import CHECKS

SOURCE_DIR = Path(__file__).with_name("csrc")
# Every kernel uses AVX512 intrinsics (and the attention kernels oneDNN's bf16 brgemm), built for
# one instruction set; CPU_CAPABILITY selects aten's AVX512 vector types in <ATen/cpu/vec/vec.h>.
# Tuples: torch's load() appends its own link flags to the list it is given.
FLAGS = ("-O3", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
         "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp")
LDFLAGS = ("-fopenmp",)

# name: (the kernel in messages, what runs where it cannot)
KERNELS = {
    "attention_fwd": ("brgemm attention forward", "aten's CPU flash forward"),
    "attention_bwd": ("brgemm (AMX or AVX512-BF16) attention backward", "aten's CPU flash backward"),
    "logprobs": ("fused CPU log-prob head", "torch's log-softmax"),
    "rmsnorm": ("fused CPU RMSNorm", "torch's RMSNorm ops"),
    "swiglu": ("fused CPU SwiGLU", "torch's SwiGLU ops"),
}


# --- the build ---------------------------------------------------------------------------------

@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold an flock on `build_dir` while torch builds or loads the extension there.

    torch's own lock is a file that a build creates and deletes: a build killed half-way (Ctrl-C
    during the first run's compile) leaves it behind, and every later process then waits on it
    forever. The kernel drops an flock when its holder dies, and every build of ours takes this
    one first, so a torch lock file (or our owner record) found while holding it was left by a
    dead build: `clear_dead_build` removes it with what that build half-wrote."""
    import fcntl

    with open(build_dir / "build.flock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# Written (with the builder's pid) before a compile starts and removed when it ends: found by the
# next holder of the flock, it means the build was killed, its outputs possibly half-written.
OWNER = "build.owner"
_COMPILERS = ("ninja", "cc1plus", "c++", "g++", "gcc", "as", "ld", "collect2", "clang", "clang++")


def _orphan_compilers(build_dir: Path) -> list[int]:
    """Compiler processes still running in `build_dir` (ninja runs there): the children of a
    killed build, which go on writing its outputs unless stopped."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "cwd") == str(build_dir) and (proc / "comm").read_text().strip() in _COMPILERS:
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def clear_dead_build(build_dir: Path) -> None:
    """Call holding the flock. A build killed part-way left its owner record (our build) or
    torch's lock file (any build); nobody holds the flock, so its builder is gone. Torch's lock
    alone is removed; with the owner record, the orphaned compilers are stopped and everything the
    build left (objects, a half-linked .so, ninja's state) is deleted, with one notice."""
    record = build_dir / OWNER
    (build_dir / "lock").unlink(missing_ok=True)
    if record.exists():
        _clean(build_dir, f"the build in {build_dir} was killed part-way (builder pid "
                          f"{record.read_text().strip()} is gone)")


def _clean(build_dir: Path, why: str) -> None:
    """Stop compilers still running in `build_dir`, delete its files, print one notice."""
    for orphan in _orphan_compilers(build_dir):
        with contextlib.suppress(OSError):
            os.kill(orphan, signal.SIGKILL)
    for path in build_dir.iterdir():
        if path.name != "build.flock" and path.is_file():
            path.unlink(missing_ok=True)
    print(f"cp_attention.native: {why}; removed its lock and partial outputs and building again",
          file=sys.stderr, flush=True)


def _import_extension(name: str, path: Path):
    """The Python extension module built at `path` (as torch's load() imports it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_key(source_dir: Path) -> str:
    """What the built binary depends on: torch's release and build, the Python ABI, the flags and
    every file compiled or included (each .cpp and .h of `source_dir`, by name and content).
    Environments and clones that agree on all of them share one cache entry (a fresh clone builds
    nothing); any that differ get their own instead of rebuilding over each other's in turn."""
    import torch

    parts = [torch.__version__, str(getattr(torch.version, "git_version", "")),
             sys.implementation.cache_tag or "", sysconfig.get_config_var("EXT_SUFFIX") or "",
             " ".join(FLAGS), " ".join(LDFLAGS)]
    digest = hashlib.sha1("\n".join(parts).encode())
    for path in sorted(p for p in source_dir.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


class Extension:
    """The .cpp files of `source_dir` built as one module named `prefix` + build_key; `label`
    names it in notices."""

    def __init__(self, source_dir: Path, prefix: str, label: str):
        self.source_dir, self.prefix, self.label = Path(source_dir), prefix, label

    @functools.cached_property
    def name(self) -> str:
        """The module's name and cache folder, hashed once (importing torch waits for first use)."""
        return self.prefix + build_key(self.source_dir)

    @property
    def build_dir(self) -> Path:
        """Where the build and its cache live: torch's extensions root, one folder per name."""
        from torch.utils.cpp_extension import get_default_build_root

        return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / self.name

    def build(self):
        """The extension: imported from the cache when built there already, else compiled.

        A cached build is imported directly, not through torch's load(): load() rebuilds when
        its build arguments change, and they hold the include paths of the torch that asks
        (inside each venv), so two clones with the same torch would rebuild over each other's
        binary in turn; the binary itself depends only on what build_key hashes."""
        from torch.utils.cpp_extension import load

        build_dir = self.build_dir
        build_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with build_lock(build_dir):
            clear_dead_build(build_dir)
            built = build_dir / f"{self.name}.so"
            if built.is_file():
                try:
                    return _import_extension(self.name, built)
                except ImportError as e:  # a .so cut short by a kill during the link
                    _clean(build_dir, f"the cached {built.name} cannot be loaded ({str(e)[:120]})")
            record = build_dir / OWNER
            record.write_text(f"{os.getpid()}\n")
            try:
                sources = sorted(str(p) for p in self.source_dir.glob("*.cpp"))
                mod = load(name=self.name, sources=sources, extra_cflags=list(FLAGS),
                           extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False)
            finally:  # ended, well or not; only a kill leaves the record
                record.unlink(missing_ok=True)
        if time.perf_counter() - t0 > 5:  # a compile, not a cache hit: say where the pause went
            print(f"cp_attention.native: built the {self.label} in {time.perf_counter() - t0:.0f} s "
                  "(cached for later runs)", file=sys.stderr, flush=True)
        return mod


EXTENSION = Extension(SOURCE_DIR, "longctx_native_", "C++ CPU kernels")


# --- can it run here ---------------------------------------------------------------------------

class _State:
    """What this process has learnt: the built module (or why the build failed), each asked
    kernel's answer, and the kernels a `disabled()` block turned off."""

    def __init__(self):
        self.module = None
        self.build_error: str | None = None
        self.reasons: dict[str, str | None] = {}
        self.blocked: dict[str, int] = {}


_STATE = _State()
_LOCK = threading.RLock()  # one build and one self-check per kernel, whichever thread asks first


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def _platform_reason() -> str | None:
    """Why no kernel of this extension can run on this machine, or None."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"built for Linux on x86-64 only (this is {platform.system()} on {platform.machine()})"
    if not cpu_has_avx512_bf16():
        native, why = native_bf16("cpu")
        return why if not native else "the CPU lacks the AVX512 BW/VL/BF16 instructions the kernels use"
    return None


def extension():
    """The built extension, without self-checks (tests of the kernels themselves); raises
    RuntimeError where it cannot be built here."""
    with _LOCK:
        if _STATE.module is None and _STATE.build_error is None:
            reason = _platform_reason()
            try:
                if reason is not None:
                    raise RuntimeError(reason)
                _STATE.module = EXTENSION.build()
            except Exception as e:  # no compiler, no ninja, a header change in another torch release
                _STATE.build_error = reason or _why(e)
                if reason is None:
                    warnings.warn(f"the {EXTENSION.label} did not build ({_STATE.build_error}); their ops run "
                                  "on torch's kernels. A C++ compiler and ninja enable them.", stacklevel=3)
        if _STATE.module is None:
            raise RuntimeError(f"the {EXTENSION.label} cannot run here: {_STATE.build_error}")
        return _STATE.module


def _decide(kernel: str) -> str | None:
    """Build (once) and self-check `kernel` (once): None, or why it cannot run here."""
    reason = _platform_reason()
    if reason is not None:
        return reason
    try:
        mod = extension()
    except RuntimeError:
        return f"the C++ extension did not build ({_STATE.build_error})"
    try:
        CHECKS[kernel](mod)
    except Exception as e:  # a wrong result, or a oneDNN path that does not exist on this CPU
        label, fallback = KERNELS[kernel]
        warnings.warn(f"{label} unavailable ({_why(e)}); using {fallback}.", stacklevel=4)
        return f"its self-check failed ({_why(e)})"
    return None


def unavailable_reason(kernel: str) -> str | None:
    """None where `kernel` (one of KERNELS) is built and self-checked on this CPU; else why it
    cannot run in this process, in words. The first ask builds the extension (or loads it from
    the cache) and self-checks that kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown native kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if _STATE.blocked.get(kernel):
        return "turned off for this block (cp_attention.native.disabled)"
    if kernel not in _STATE.reasons:
        with _LOCK:
            if kernel not in _STATE.reasons:
                _STATE.reasons[kernel] = _decide(kernel)
    return _STATE.reasons[kernel]


def kernel(name: str):
    """The extension module, for an entry point of kernel `name`; RuntimeError where that kernel
    cannot run (callers ask unavailable_reason first)."""
    reason = unavailable_reason(name)
    if reason is not None:
        raise RuntimeError(f"{KERNELS[name][0]} cannot run here: {reason}")
    return _STATE.module


def disable(kernel: str, error: Exception) -> None:
    """Turn `kernel` off for the rest of the process after a call of it failed, with one warning:
    a training run falls back to torch's kernel rather than dying mid-step."""
    label, fallback = KERNELS[kernel]
    warnings.warn(f"{label} unavailable ({_why(error)}); using {fallback}.", stacklevel=3)
    _STATE.reasons[kernel] = f"a call failed ({_why(error)})"


@contextlib.contextmanager
def disabled(*kernels: str):
    """Within the block, `kernels` (all when none are named) answer unavailable, so the torch path
    runs: tests and benchmarks compare the two in one process."""
    names = kernels or tuple(KERNELS)
    for name in names:
        if name not in KERNELS:
            raise ValueError(f"unknown native kernel {name!r}: one of {', '.join(KERNELS)}")
        _STATE.blocked[name] = _STATE.blocked.get(name, 0) + 1
    try:
        yield
    finally:
        for name in names:
            _STATE.blocked[name] -= 1
