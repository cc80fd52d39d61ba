import os

from hypothesis import HealthCheck, settings

# Shared, noisy 2-core machines: hypothesis must not fail a test because one example was slow.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
