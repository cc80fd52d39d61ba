"""A non-editable install carries every source of the native extension: the project is installed
with pip into a fresh virtual environment (offline: no dependencies, no build isolation), and a
process outside the source tree imports the installed packages, builds the extension from the
installed sources into an empty cache and self-checks every kernel there.

The fresh environment sees this one's site-packages (torch, setuptools, pip) through a .pth file,
whose entries are plain paths: the editable install's finder in that folder is not run, so the
only copy of the project it can import is the one pip installed."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cp_attention import native
from cp_attention.hardware import cpu_has_avx512_bf16

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_packing", "cp_attention", "longctx_moe", "rl_hooks")  # pyproject's packages.find

CHECK = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("error")  # a build or self-check that falls back to torch fails
    from cp_attention import native
    from longctx_moe.kernels import cpu_logprobs, cpu_rmsnorm, cpu_swiglu
    venv = sys.argv[1]
    for mod in (native, cpu_logprobs):
        assert mod.__file__.startswith(venv), mod.__file__  # the installed copy, not the tree
    for kernel in native.KERNELS:
        reason = native.unavailable_reason(kernel)
        assert reason is None, (kernel, reason)
    assert cpu_logprobs.available() and cpu_rmsnorm.available() and cpu_swiglu.available()
    print(native.EXTENSION.name)
""")


def _copy_project(dst: Path) -> Path:
    """The project's installable files (pip builds in the folder it is given: not in ours)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    for path in [ROOT / "pyproject.toml", ROOT / "README.md", *ROOT.glob("LICEN[CS]E*")]:
        shutil.copy(path, dst / path.name)
    return dst


def _sources(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.suffix in (".cpp", ".h")}


def _fresh_venv(path: Path) -> Path:
    """A venv without pip whose python also sees this environment's site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_dev_site_packages.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    return python


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="no AVX512-BF16 here: the native kernels are not built")
def test_a_non_editable_install_builds_and_self_checks_every_kernel(tmp_path):
    project = _copy_project(tmp_path / "project")
    python = _fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    install = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                              "--no-cache-dir", "-q", str(project)],
                             capture_output=True, text=True, env=env, timeout=300)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    installed = next((tmp_path / "venv").glob("lib/python*/site-packages/cp_attention/csrc"))
    assert _sources(installed) == _sources(native.SOURCE_DIR)  # named here, before a build can fail

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([python, "-c", CHECK, str(tmp_path / "venv")], cwd=elsewhere,
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    # The installed sources are this tree's, every file of them (the key hashes each by name and
    # content), and they were compiled there, into the empty cache.
    name = run.stdout.strip().splitlines()[-1]
    assert name == native.EXTENSION.name
    assert (tmp_path / "ext" / name / f"{name}.so").is_file()
