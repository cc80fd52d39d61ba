import os

from hypothesis import HealthCheck, settings

# Shared, noisy 2-core machines: hypothesis must not fail a test because one example was slow.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionstart(session):
    # Build (or load) the brgemm attention kernels once, here, before any test runs: a first build
    # takes ~20-30 s, which would otherwise land inside one test, or inside a distributed test's
    # timeout with every rank waiting on the same build lock. Without AVX512-BF16 (AMX included)
    # this does nothing.
    from cp_attention.kernels import amx_backward, brgemm_forward

    amx_backward.available()
    brgemm_forward.available()
