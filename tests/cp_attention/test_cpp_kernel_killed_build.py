"""A C++ kernel build SIGKILLed part-way (tests/cp_attention/test_cpp_kernel.py covers torch's
lock file alone): the next process stops the dead build's compilers, deletes what it half-wrote
and builds again, with one notice, instead of loading a half-linked binary (which switched the
kernel off in every later run) or racing the orphaned compiler."""

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

from cp_attention.kernels import brgemm_forward
from cp_attention.kernels._cpp_kernel import cpu_has_avx512_bf16

ROOT = Path(__file__).resolve().parents[2]

# A build killed while linking: torch's load() has taken its lock file, its compiler still runs
# in the build directory (here a copy of `sleep` named cc1plus), the .so holds its first bytes.
KILLED_BUILD = textwrap.dedent("""
    import os, shutil, signal, subprocess, sys
    import torch.utils.cpp_extension as ext
    from cp_attention.kernels import brgemm_forward

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
    brgemm_forward.KERNEL.build()
""")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_a_build_killed_part_way_is_cleared_and_rebuilt_with_one_notice(tmp_path, monkeypatch, capfd):
    if not cpu_has_avx512_bf16() or shutil.which("sleep") is None:
        pytest.skip("no AVX512-BF16 here: the kernel is never built")
    ext_dir = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext_dir))  # a fresh cache: a real first build
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(tmp_path)], cwd=ROOT, env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    orphan = int((tmp_path / "orphan.pid").read_text())
    build_dir = brgemm_forward.KERNEL.build_dir
    assert _running(orphan) and (build_dir / "lock").exists()

    monkeypatch.setattr(brgemm_forward.KERNEL, "state", {})
    capfd.readouterr()
    try:
        assert brgemm_forward.available()  # built anew and self-checked, not switched off
    finally:
        if _running(orphan):
            os.kill(orphan, signal.SIGKILL)
    err = capfd.readouterr().err
    notices = [line for line in err.splitlines() if "killed part-way" in line]
    assert len(notices) == 1 and str(build_dir) in notices[0], err
    time.sleep(0.1)
    assert not _running(orphan)  # the dead build's compiler was stopped before the rebuild
    assert not (build_dir / "lock").exists() and not (build_dir / "build.owner").exists()
