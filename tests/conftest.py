import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Shared, noisy 2-core machines: hypothesis must not fail a test because one example was slow.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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


def pytest_sessionstart(session):
    # Build (or load) the brgemm attention kernels once, here, before any test runs: a first build
    # takes ~20-30 s, which would otherwise land inside one test, or inside a distributed test's
    # timeout with every rank waiting on the same build lock. Without AVX512-BF16 (AMX included)
    # this does nothing.
    from cp_attention.kernels import amx_backward, brgemm_forward

    amx_backward.available()
    brgemm_forward.available()


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
