"""A C++ kernel built on first use with torch.utils.cpp_extension, self-checked once, and switched
off for the process with one warning when it cannot run (the adapters brgemm_forward and
amx_backward each hold one).

Decided once per process: `module()` is the built, self-checked extension or None. It is None
unless the CPU is Linux x86-64 with AVX512-BF16 (AMX included) that oneDNN uses
(cp_attention.hardware, whose AVX2 emulation switches it off too) and the environment switch is
not "0"; a failed build (no compiler, no ninja, another torch's headers) or self-check warns once
and leaves the caller on aten's kernel, as does a later failing call (`disable`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from cp_attention.hardware import cpu_has_avx512_bf16

# Both kernels use AVX512 intrinsics and oneDNN's bf16 brgemm, built for one instruction set.
_FLAGS = ["-O3", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
          "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]


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


def clear_dead_build(build_dir: Path, label: str, owner: str = "cp_attention") -> None:
    """Call holding the flock. A build killed part-way left its owner record (our build) or
    torch's lock file (any build); nobody holds the flock, so its builder is gone. Torch's lock
    alone is removed; with the owner record, the orphaned compilers are stopped and everything the
    build left (objects, a half-linked .so, ninja's state) is deleted, with one notice."""
    record = build_dir / OWNER
    (build_dir / "lock").unlink(missing_ok=True)
    if record.exists():
        _clean(build_dir, f"the build of the {label} in {build_dir} was killed part-way (builder pid "
                          f"{record.read_text().strip()} is gone)", owner)


def _clean(build_dir: Path, why: str, owner: str) -> None:
    """Stop compilers still running in `build_dir`, delete its files, print one notice."""
    for orphan in _orphan_compilers(build_dir):
        with contextlib.suppress(OSError):
            os.kill(orphan, signal.SIGKILL)
    for path in build_dir.iterdir():
        if path.name != "build.flock" and path.is_file():
            path.unlink(missing_ok=True)
    print(f"{owner}: {why}; removed its lock and partial outputs and building again",
          file=sys.stderr, flush=True)


def _import_extension(name: str, path: Path):
    """The Python extension module built at `path` (as torch's load() imports it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_key(source: Path) -> str:
    """What the built binary depends on: torch's release and build, the Python ABI, the flags
    and the source. Environments and clones that agree on all of them share one cache entry (a
    fresh clone builds nothing); any that differ get their own instead of rebuilding over each
    other's on every switch."""
    import torch

    parts = [torch.__version__, str(getattr(torch.version, "git_version", "")),
             sys.implementation.cache_tag or "", " ".join(_FLAGS)]
    digest = hashlib.sha1("\n".join(parts).encode())
    digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


class CppKernel:
    """source: the .cpp beside this file (or an absolute path); cache_prefix: the build's name, to which build_key is
    appended; env: the switch; label: the kernel in messages; fallback: what runs instead, in
    messages; self_check(mod) raises if the kernel is wrong here."""

    def __init__(self, source: str, cache_prefix: str, env: str, label: str, fallback: str,
                 self_check: Callable):
        self.source = Path(__file__).parent / source
        self.owner = self.source.parent.parent.name  # the package whose kernel it is, in notices
        self.cache_prefix = cache_prefix
        self.env, self.label, self.fallback, self.self_check = env, label, fallback, self_check
        self.state: dict = {}

    @functools.cached_property
    def name(self) -> str:
        """The extension's module name and cache folder, hashed once (importing torch waits for
        first use)."""
        return self.cache_prefix + build_key(self.source)

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
            clear_dead_build(build_dir, self.label, self.owner)
            built = build_dir / f"{self.name}.so"
            if built.is_file():
                try:
                    return _import_extension(self.name, built)
                except ImportError as e:  # a .so cut short by a kill during the link
                    _clean(build_dir, f"the cached {built.name} cannot be loaded ({str(e)[:120]})", self.owner)
            record = build_dir / OWNER
            record.write_text(f"{os.getpid()}\n")
            try:
                mod = load(name=self.name, sources=[str(self.source)], extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
            finally:  # ended, well or not; only a kill leaves the record
                record.unlink(missing_ok=True)
        if time.perf_counter() - t0 > 5:  # a compile, not a cache hit: say where the pause went
            print(f"{self.owner}: built the {self.label} in {time.perf_counter() - t0:.0f} s "
                  "(cached for later runs)", file=sys.stderr, flush=True)
        return mod

    def disable(self, e: Exception) -> None:
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        warnings.warn(f"{self.label} unavailable ({why}); using {self.fallback}. "
                      f"A C++ compiler and ninja enable it; {self.env}=0 silences this.",
                      stacklevel=4)
        self.state["mod"] = None

    def module(self):
        """The built, self-checked extension, or None where it cannot be used here."""
        if "mod" in self.state:
            return self.state["mod"]
        mod = None
        wanted = os.environ.get(self.env, "1") != "0"
        if (wanted and platform.system() == "Linux" and platform.machine() == "x86_64"
                and cpu_has_avx512_bf16()):
            try:
                mod = self.build()
                self.self_check(mod)
            except Exception as e:  # no compiler, no ninja, a header change in another torch release
                self.disable(e)
                return None
        self.state["mod"] = mod
        return mod

    def available(self) -> bool:
        return self.module() is not None

    @contextlib.contextmanager
    def disabled(self):
        """Run the block on aten's kernel (benchmarks compare the two in one process)."""
        mod = self.module()
        self.state["mod"] = None
        try:
            yield
        finally:
            self.state["mod"] = mod
