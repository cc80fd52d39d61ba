"""A C++ kernel build SIGKILLed part-way (tests/cp_attention/test_cpp_kernel.py covers torch's
lock file alone): the next process stops the dead build's compilers, deletes what it half-wrote
and builds again, with one notice, instead of loading a half-linked binary (which switched the
kernel off in every later run) or racing the orphaned compiler.

The extension built here is a module with no code, through the native extension's own builder
(`cp_attention.native.Extension`): the build, lock and clean-up steps are the same, and it
compiles in about a second where the real kernels take most of a minute of two cores (they are
built, once per machine, by the session's start in conftest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# An extension module with nothing in it: torch's load() names it with -DTORCH_EXTENSION_NAME.
EMPTY_EXTENSION = textwrap.dedent("""
    #include <Python.h>
    #define CAT_(a, b) a##b
    #define CAT(a, b) CAT_(a, b)
    #define STR_(a) #a
    #define STR(a) STR_(a)
    static struct PyModuleDef empty = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
    PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&empty); }
""")


def _kernel(source_dir: Path):
    from cp_attention.native import Extension

    return Extension(source_dir, "longctx_test_empty_", "empty test kernel")


# A build killed while linking: torch's load() has taken its lock file, its compiler still runs
# in the build directory (here a copy of `sleep` named cc1plus), the .so holds its first bytes.
KILLED_BUILD = textwrap.dedent("""
    import os, shutil, signal, subprocess, sys
    import torch.utils.cpp_extension as ext
    from tests.cp_attention.test_cpp_kernel_killed_build import _kernel

    def load(name, build_directory, **kw):
        d = build_directory
        open(os.path.join(d, "lock"), "w").close()
        cc = os.path.join(sys.argv[1], "cc1plus")
        shutil.copy(shutil.which("sleep"), cc)
        proc = subprocess.Popen([cc, "600"], cwd=d, start_new_session=True)
        with open(os.path.join(sys.argv[1], "orphan.pid"), "w") as f:
            f.write(str(proc.pid))
        with open(os.path.join(d, name + ".so"), "wb") as f:
            f.write(b"\\x7fELF\\x02\\x01\\x01" + bytes(57))
        os.kill(os.getpid(), signal.SIGKILL)

    ext.load = load
    _kernel(sys.argv[2]).build()
""")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_a_build_killed_part_way_is_cleared_and_rebuilt_with_one_notice(tmp_path, monkeypatch, capfd):
    if shutil.which("sleep") is None:
        pytest.skip("no `sleep` program to stand in for the orphaned compiler")
    source = tmp_path / "csrc"
    source.mkdir()
    (source / "empty.cpp").write_text(EMPTY_EXTENSION)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # a fresh cache
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(tmp_path), str(source)], cwd=ROOT, env=env,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL
    orphan = int((tmp_path / "orphan.pid").read_text())
    kernel = _kernel(source)
    build_dir = kernel.build_dir
    assert _running(orphan) and (build_dir / "lock").exists()

    from cp_attention import native

    key = native.build_key(native.SOURCE_DIR)
    capfd.readouterr()
    try:
        assert kernel.build().__name__ == kernel.name  # built anew and imported, not the half-linked .so
    finally:
        if _running(orphan):
            os.kill(orphan, signal.SIGKILL)
    err = capfd.readouterr().err
    notices = [line for line in err.splitlines() if "killed part-way" in line]
    assert len(notices) == 1 and str(build_dir) in notices[0], err
    time.sleep(0.1)
    assert not _running(orphan)  # the dead build's compiler was stopped before the rebuild
    assert not (build_dir / "lock").exists() and not (build_dir / "build.owner").exists()
    # torch's load() extends the flag lists it is given: the builder's own, hashed into every
    # key, must come out of a build unchanged
    assert native.build_key(native.SOURCE_DIR) == key
