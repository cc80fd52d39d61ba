"""The distributed test launcher: results by rank, errors re-raised, deadlocks time out."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.launcher import DistributedTestError, run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _deadlock(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never joins: it is stuck elsewhere
    else:
        time.sleep(600)


@pytest.mark.slow
def test_results_come_back_by_rank():
    assert run_distributed(_sum_ranks, 3, timeout=120) == [3.0, 3.0, 3.0]


@pytest.mark.slow
def test_error_on_one_rank_is_reraised_with_its_traceback():
    with pytest.raises(DistributedTestError, match="boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout=120)


@pytest.mark.slow
def test_deadlock_fails_instead_of_hanging():
    # The bound is the test's wait: rank 1 never reports, so any bound shows the launcher gives up.
    with pytest.raises(DistributedTestError, match="did not finish"):
        run_distributed(_deadlock, 2, timeout=3)


@pytest.mark.slow
def test_a_port_taken_before_the_store_listens_is_retried_on_another(monkeypatch):
    """Under several pytest workers another process can take the port free_port found before rank
    0's store binds it: the launch runs once more on a new port instead of failing the test."""
    import socket

    from tests import launcher

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # a listening socket: the store's bind fails with EADDRINUSE
    ports = [taken.getsockname()[1]]
    real = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: ports.pop(0) if ports else real())
    try:
        assert run_distributed(_sum_ranks, 2, timeout=120) == [1.0, 1.0]
    finally:
        taken.close()
    assert not ports  # the taken port was handed out first
