import hashlib
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Shared, noisy 2-core machines: hypothesis must not fail a test because one example was slow.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Bytecode is cached for the test run (in __pycache__, which git ignores) even where
# PYTHONDONTWRITEBYTECODE is set, as on the machines we test on: otherwise each xdist worker
# rewrites every test module's assertions again (half of its 7 s collection) and every process
# the suite starts (CLI runs, torchrun and Ray ranks, rehearsals) compiles the project again.
# Set before any test module is imported; the processes the tests start inherit it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The Triton kernels' tests run under Triton's interpreter (numpy on CPU tensors; tests/kernels).
# Triton reads the switch when `@triton.jit` runs, in its own modules too: set before any test
# module is collected, since some (transformers, verl) import triton at their import.
os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile's on-disk cache does not key its entries by the ISA caps of the AVX2 emulation
# (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA): a float64 block compiled under `make test-avx2` and
# reused natively (or the other way) gave NaN losses. Each ISA setting gets its own cache.
_ISA = "-".join(os.environ.get(v, "native") for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path(os.environ.get("TMPDIR", "/tmp")) / f"torchinductor_longctx_{_ISA}"))


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process_groups(request):
    """A test that starts gloo processes belongs to the slow tier, except the one `multirank`
    exactness test per feature: this keeps `pytest -m "not slow"` fast as tests are added."""
    from tests import launcher

    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("multirank"):
        yield
        return

    def refuse():
        raise AssertionError(f"{request.node.nodeid} starts gloo processes: mark it "
                             "@pytest.mark.slow (or multirank if it is its feature's one fast "
                             "multi-rank exactness test)")

    launcher.tier_check = refuse
    yield
    launcher.tier_check = None


@pytest.fixture(autouse=True)
def _denormals_restored():
    """A trainer built in this process (`configure_cpu`) flushes denormals for the whole process;
    the next test must see IEEE floats again (hypothesis refuses to draw subnormals otherwise)."""
    yield
    import torch

    torch.set_flush_denormal(False)


def _xdist_worker(config) -> bool:
    """True in a pytest-xdist worker process (`make test` runs several), False in the controller
    or a plain run."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    # Build (or load) the native extension (the C++ CPU kernels: attention, log-prob head, RMSNorm,
    # SwiGLU) and self-check each kernel once, here, before any test runs: a first build takes
    # ~30-60 s, which would otherwise land inside one test, or inside a distributed test's timeout
    # with every rank waiting on the same build lock. Without AVX512-BF16 (AMX included) this
    # builds nothing.
    from cp_attention import native

    for kernel in native.KERNELS:
        native.unavailable_reason(kernel)
    if _xdist_worker(session.config):
        # `make test` runs more xdist workers than cores: a worker's own intra-op threads would
        # only contend with the others' (and spin in OpenMP barriers meanwhile).
        import torch

        torch.set_num_threads(1)
    report = session.config.getoption("--cpu-report")
    if report and not _xdist_worker(session.config):
        open(report + ".partial", "w").close()  # this run's rows only


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The bundled stdlib corpus, packed once per test run: `longctx-pack --source stdlib` with a
    512-token BPE, rows of 256 tokens, 40 documents. Every end-to-end trainer test reads it; a test
    that wrote into it would change what the tests after it read, so that fails the run."""
    from data_packing.cli import main as pack_main

    out = tmp_path_factory.mktemp("corpus") / "stdlib_small"
    rc = pack_main(["--source", "stdlib", "--train-tokenizer", "512", "--seq-len", "256", "--max-docs", "40",
                    "--seed", "0", "--no-progress", "--output", str(out)])
    assert rc in (0, None)
    digest = _tree_digest(out)
    yield out
    assert _tree_digest(out) == digest, f"a test wrote into the shared packed corpus {out}; copy it first"


# CPU accounting per test (`pytest --cpu-report=PATH`): on a shared machine wall time measures the
# neighbours as much as the test, so the suite's budget is kept in CPU seconds. Each test is charged
# the CPU of this process, of its waited children (RUSAGE_CHILDREN) and of every live descendant
# with what that one has reaped (the forkserver and its gloo ranks, Ray's workers), as deltas from
# its setup to its teardown.
def pytest_addoption(parser):
    parser.addoption("--cpu-report", metavar="PATH", default=None,
                     help="write each test's CPU seconds (with its child processes) to PATH, "
                          "tab-separated, and list the 25 costliest at the end")


def _tree_cpu_s() -> dict[int, float]:
    import resource

    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    out = {0: own}
    try:
        import psutil
    except ImportError:  # psutil comes with ray (dev extra); without it, waited children only
        return out
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # ended between the listing and the reading
            pass
    return out


def _cpu_delta_s(before: dict[int, float], after: dict[int, float]) -> float:
    """New processes count from zero; one that ended is in its reaper's reading with its whole
    life, so the part it had used before the test (its own earlier reading) comes off. A process
    reparented out of the tree (a daemon) is lost with what it used during the test."""
    return sum(after.values()) - sum(before.values())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.config.getoption("--cpu-report"):
        yield
        return
    import time

    before, t0 = _tree_cpu_s(), time.monotonic()
    yield
    cpu, wall = _cpu_delta_s(before, _tree_cpu_s()), time.monotonic() - t0
    # Appended as each test ends (by every xdist worker), so a run stopped part-way still tells
    # where its time went; the summary reads the rows back from this file.
    with open(item.config.getoption("--cpu-report") + ".partial", "a") as f:
        f.write(f"{cpu:.2f}\t{wall:.2f}\t{item.nodeid}\n")


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("--cpu-report")
    if not path or _xdist_worker(config):
        return
    with open(path + ".partial") as f:
        rows = sorted(((float(c), float(w), n) for c, w, n in (line.rstrip("\n").split("\t", 2) for line in f)),
                      reverse=True)
    if not rows:
        return
    total = sum(r[0] for r in rows)
    with open(path, "w") as f:
        f.write(f"# cpu_s\twall_s\ttest (total cpu {total:.1f} s over {len(rows)} tests)\n")
        f.writelines(f"{c:.2f}\t{w:.2f}\t{n}\n" for c, w, n in rows)
    terminalreporter.write_sep("=", f"CPU seconds per test (total {total:.1f} s; all in {path})")
    for c, w, n in rows[:25]:
        terminalreporter.write_line(f"{c:8.2f} cpu {w:8.2f} wall  {n}")


def pytest_collection_modifyitems(items):
    """Longest first: files with a `long` test (by the seconds the mark gives, most first), then
    files with multi-process (`slow`) tests, then the rest. `make test`'s workers take whole files
    in collection order; a file that runs for minutes started at the end would leave the other
    workers idle while it finishes. Otherwise the order is unchanged."""
    long_s: dict = {}
    for item in items:
        mark = item.get_closest_marker("long")
        if mark:
            long_s[item.path] = max(long_s.get(item.path, 0), mark.kwargs.get("seconds", 20))
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (-long_s.get(item.path, 0), item.path not in heavy))
