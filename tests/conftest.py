import os

from hypothesis import HealthCheck, settings

# Shared, noisy 2-core machines: hypothesis must not fail a test because one example was slow.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionstart(session):
    # Build (or load) the AMX attention backward once, here, before any test runs: the first build
    # takes ~30 s, which would otherwise land inside one test, or inside a distributed test's
    # timeout with every rank waiting on the same build lock. Without AMX this does nothing; the
    # brgemm forward likewise needs AVX512-BF16.
    from cp_attention.kernels import amx_backward, brgemm_forward

    amx_backward.available()
    brgemm_forward.available()
