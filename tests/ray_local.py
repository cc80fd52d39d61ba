"""A Ray cluster private to one test module: `num_cpus` logical CPUs on this machine (two by
default), skipped (with the reason given) where Ray is not installed."""

from __future__ import annotations

import os

import pytest


def local_ray_cluster(reason: str, num_cpus: int = 2):
    """Generator for a module-scoped fixture: `yield from local_ray_cluster("... needs ray")`."""
    ray = pytest.importorskip("ray", reason=reason)
    # Token auth is irrelevant to a cluster private to this test process.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
