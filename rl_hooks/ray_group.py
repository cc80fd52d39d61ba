"""RayPolicyGroup: the ranks of one PolicyTrainer as Ray actors, behind one handle in the driver.

An RL driver in the verl / OpenRLHF style owns the loop (rollouts, rewards, updates) in one
process and reaches its trainer through Ray. Here each trainer rank is an actor that sets
torchrun's environment (rank 0's node address and a free port on it as the rendezvous), builds
the same `PolicyTrainer` as `torchrun` would, and runs its methods; every call of the handle goes
to every rank, in the same order, and returns rank 0's result (the ranks agree: metrics are
all-reduced and log-probs gathered).

    group = RayPolicyGroup(load_config("configs/tiny_cpu.yaml", ["parallel.ep=2"]), num_ranks=2)
    old = group.compute_logprobs(batch, record_routes=True)
    metrics = group.train_step(batch, make_loss(PolicyLossConfig(kind="ppo")))
    group.push_weights(sink)            # the sink runs on rank 0; or: for bucket in group.export_weights()
    group.shutdown()

Placement: one bundle per rank ({"CPU": cpus_per_rank, "GPU": gpus_per_rank}) in a placement group
the handle creates (PACK: ranks share nodes where they fit), or bundles of a placement group the
caller made. gloo on CPU, NCCL when the ranks hold GPUs (train.device=auto picks CUDA then).

Failures: an exception on any rank is raised in the driver as a RayGroupError naming the rank,
the call and the cause (the rank's traceback is chained). Ranks still blocked in a collective with
the failed one leave the group unusable; it says so on the next call: shutdown() and build anew.

Ray is imported here only, and only when a group is built (`pip install 'longctx-moe[rl]'`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from rl_hooks.batch import RolloutBatch


class RayGroupError(RuntimeError):
    """A call failed on one or more ranks: `rank` is the lowest of them, `cause` its exception."""

    def __init__(self, message: str, rank: int, failed: list[int], cause: BaseException):
        super().__init__(message)
        self.rank, self.failed, self.cause = rank, failed, cause


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("RayPolicyGroup needs Ray: pip install 'longctx-moe[rl]'") from None
    return ray


# ---------------------------------------------------------------------- inside each actor


class _Rank:
    """One trainer rank inside a Ray actor (wrapped by ray.remote when a group is built)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.policy = rank, world_size, None

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0's are every rank's MASTER_ADDR/PORT)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, cfg, master: tuple[str, int], local_rank: int, local_world: int,
              cpus: float, policy_kwargs: dict[str, Any]) -> None:
        """torchrun's environment for this rank, then the PolicyTrainer (joins the process group)."""
        import ray

        from rl_hooks.api import PolicyTrainer

        device_index = _device_index([str(i) for i in ray.get_gpu_ids()], local_rank)
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(device_index),
                          LOCAL_WORLD_SIZE=str(local_world))
        if cfg.train.num_threads == 0 and cfg.train.host_tuning == "full":
            # Ray granted this actor `cpus` cores; a tuned host's default (the node's cores /
            # ranks on the node) would oversubscribe a node shared with other actors (rollout
            # engines). Untuned, the actor keeps Ray's count (OMP_NUM_THREADS = its CPUs).
            train = dataclasses.replace(cfg.train, num_threads=max(1, int(cpus)))
            cfg = dataclasses.replace(cfg, train=train)
        self.policy = PolicyTrainer(cfg, **policy_kwargs)

    def call(self, method: str, reply: bool, *args, **kwargs):
        out = getattr(self.policy, method)(*args, **kwargs)
        return out if reply else None

    def apply(self, fn: Callable, *args, **kwargs):
        return fn(self.policy, *args, **kwargs)

    def export(self, bucket_bytes: int, dtype):
        yield from self.policy.export_weights(bucket_bytes, dtype)

    def drain_export(self, bucket_bytes: int, dtype) -> None:
        # The export is collective: every rank iterates it to the end, even one that keeps nothing.
        from rl_hooks.export import ExportAbandoned

        try:
            for _ in self.policy.export_weights(bucket_bytes, dtype):
                pass
        except ExportAbandoned:  # rank 0 stopped at the driver's request (stop_export)
            pass

    def stop_export(self) -> None:
        """Runs in the "control" concurrency group, beside a running export: ends it at the next
        bucket on every rank."""
        if self.policy is not None:
            self.policy.export_gate.stop()

    def close(self) -> None:
        from longctx_moe.parallel.dims import destroy_process_groups

        self.policy = None  # its ParallelDims holds the groups
        destroy_process_groups()


# ---------------------------------------------------------------------- the driver's handle


class RayPolicyGroup:
    """`num_ranks` PolicyTrainer ranks built from `cfg` (the Config `longctx-moe train` takes; its
    parallel layout must fit `num_ranks`). `gpus_per_rank` defaults to 1 for train.device=cuda,
    0 for cpu, and for auto to 1 when the Ray cluster has GPUs. `placement_group`: the caller's,
    with a bundle per rank (rank i on bundle i); else the group makes one with `strategy`.
    `micro_batch_tokens`, `advantage_estimator`, `batch_invariant` are PolicyTrainer's.
    `grace_s`: after one rank fails, how long to wait for the others to report theirs."""

    def __init__(self, cfg, num_ranks: int, *, cpus_per_rank: float = 1,
                 gpus_per_rank: float | None = None, placement_group=None, strategy: str = "PACK",
                 env: dict[str, str] | None = None, ready_timeout_s: float = 300.0,
                 grace_s: float = 10.0, micro_batch_tokens: int | None = None,
                 advantage_estimator: str = "grpo", batch_invariant: bool | None = None):
        ray = _import_ray()
        from longctx_moe.build import check_layout

        check_layout(cfg, num_ranks)  # an impossible layout fails here, before any actor starts
        self.cfg, self.num_ranks, self.grace_s = cfg, num_ranks, grace_s
        self._broken: str | None = None
        self._actors: list = []
        self._pg, self._own_pg = None, placement_group is None
        if not ray.is_initialized():
            ray.init()  # what Ray's first remote call would do: join RAY_ADDRESS or start locally
        gpus = _gpus_per_rank(ray, cfg, gpus_per_rank)
        self._pg = placement_group or _make_placement_group(ray, num_ranks, cpus_per_rank, gpus,
                                                            strategy, ready_timeout_s)
        if self._pg.bundle_count < num_ranks:
            self.shutdown()
            raise ValueError(f"placement_group has {self._pg.bundle_count} bundles for "
                             f"num_ranks={num_ranks}; give it one bundle per rank")
        try:
            self._actors = _start_actors(ray, self._pg, num_ranks, cpus_per_rank, gpus, env)
            self._setup(cfg, cpus_per_rank, {"micro_batch_tokens": micro_batch_tokens,
                                             "advantage_estimator": advantage_estimator,
                                             "batch_invariant": batch_invariant})
        except BaseException:
            self.shutdown()
            raise

    def _setup(self, cfg, cpus: float, policy_kwargs: dict[str, Any]) -> None:
        nodes = self._wait([a.node.remote() for a in self._actors], "start")
        master = self._wait([self._actors[0].rendezvous.remote()], "rendezvous")[0]
        refs = []
        for rank, actor in enumerate(self._actors):
            local = [r for r in range(self.num_ranks) if nodes[r] == nodes[rank]]
            refs.append(actor.setup.remote(cfg, master, local.index(rank), len(local), cpus,
                                           policy_kwargs))
        self._wait(refs, "PolicyTrainer construction")

    # ------------------------------------------------------------------ the policy calls

    def compute_logprobs(self, batch: RolloutBatch, temperature: float = 1.0,
                         return_entropy: bool = False, record_routes: bool = False,
                         mini_batches: int = 1):
        """PolicyTrainer.compute_logprobs on every rank; rank 0's LogProbs."""
        self.validate(batch)
        return self._fan_out("compute_logprobs", _put(batch), temperature=temperature,
                             return_entropy=return_entropy, record_routes=record_routes,
                             mini_batches=mini_batches)

    def train_step(self, batch: RolloutBatch, loss, mini_batches: int = 1, epochs: int = 1,
                   lr: float | None = None, temperature: float = 1.0) -> dict[str, Any]:
        """PolicyTrainer.train_step on every rank; rank 0's metrics (all-reduced: every rank's)."""
        self.validate(batch)
        return self._fan_out("train_step", _put(batch), loss, mini_batches=mini_batches,
                             epochs=epochs, lr=lr, temperature=temperature)

    def validate(self, batch: RolloutBatch) -> None:
        """The batch's contract, checked in the driver (a RolloutBatchError, as in PolicyTrainer)."""
        m = self.cfg.model
        batch.validate(m.vocab_size, m.num_moe_layers, m.top_k, m.num_experts)

    def info(self) -> dict[str, Any]:
        return self._on_rank0("info")

    def weights_spec(self, dtype=None):
        import torch

        return self._on_rank0("weights_spec", dtype or torch.bfloat16)

    def export_weights(self, bucket_bytes: int = 512 << 20, dtype=None) -> Iterator[list]:
        """Rank 0's buckets of (HF name, tensor), streamed to the driver as they are made (the
        other ranks take part in each bucket's gathers). Leaving it early (break, close) stops
        every rank at the next bucket and frees what rank 0 had sent ahead."""
        import torch

        ray = _import_ray()
        dtype = dtype or torch.bfloat16
        self._usable()
        # Rank 0 runs at most AHEAD buckets ahead of the driver: a driver that stops reading holds
        # that many in the object store, not the whole export.
        stream = self._actors[0].export.options(num_returns="streaming", _generator_backpressure_num_objects=AHEAD
                                                ).remote(bucket_bytes, dtype)
        drains = {a.drain_export.remote(bucket_bytes, dtype): r
                  for r, a in enumerate(self._actors) if r > 0}
        try:
            yield from self._stream(ray, stream, drains)
        except GeneratorExit:  # the driver stopped reading: stop rank 0, free what it sent
            ray.get(self._actors[0].stop_export.options(concurrency_group="control").remote())
            for ref in stream:
                del ref  # each bucket's object is freed once its last reference is gone
            self._wait(list(drains), "export_weights", ranks=list(drains.values()))
            raise

    def _stream(self, ray, stream, drains: dict) -> Iterator[list]:
        while True:
            # Wait on the peers too: one failing mid-export would otherwise leave rank 0 blocked
            # in a gather until the process-group timeout.
            ready, _ = ray.wait([stream, *drains], num_returns=1)
            if ready[0] is not stream:
                self._wait([ready[0]], "export_weights", ranks=[drains.pop(ready[0])])
                continue
            try:
                bucket = ray.get(next(stream))
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - becomes a RayGroupError naming rank 0
                self._raise({0: e}, "export_weights", pending=bool(drains))
            yield bucket
        self._wait(list(drains), "export_weights", ranks=list(drains.values()))

    def push_weights(self, sink: Callable[[list], None], bucket_bytes: int = 512 << 20,
                     dtype=None, ranks: tuple[int, ...] = (0,)) -> dict[str, float]:
        """Stream the export to `sink(bucket)` on each rank of `ranks` (the sink is pickled to
        them: e.g. a function calling a rollout engine actor's loader); rank 0's stats."""
        import torch

        dtype = dtype or torch.bfloat16
        refs = [a.call.remote("push_weights", r == 0, sink if r in ranks else _discard,
                              bucket_bytes, dtype) for r, a in enumerate(self._ready_actors())]
        return self._wait(refs, "push_weights")[0]

    def set_lr(self, lr: float) -> None:
        self._fan_out("set_lr", lr)

    def save(self, path: str) -> None:
        self._fan_out("save", path)

    def load(self, path: str) -> None:
        self._fan_out("load", path)

    def apply(self, fn: Callable, *args, **kwargs) -> list:
        """`fn(policy, *args, **kwargs)` on every rank (a module-level or pickleable function);
        every rank's result, by rank."""
        refs = [a.apply.remote(fn, *args, **kwargs) for a in self._ready_actors()]
        return self._wait(refs, getattr(fn, "__name__", "apply"))

    # ------------------------------------------------------------------ life cycle

    def shutdown(self) -> None:
        """Leave the process group, end the actors, free the placement group the group made."""
        ray = _import_ray()
        if self._actors and not self._broken:
            try:
                ray.get([a.close.remote() for a in self._actors], timeout=self.grace_s)
            except Exception:  # noqa: BLE001 - the actors are killed below either way
                pass
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._own_pg and self._pg is not None:
            ray.util.remove_placement_group(self._pg)
        self._pg = None
        self._broken = "the group was shut down; build a new RayPolicyGroup"

    def __enter__(self) -> RayPolicyGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ fan-out and errors

    def _fan_out(self, method: str, *args, **kwargs):
        refs = [a.call.remote(method, r == 0, *args, **kwargs)
                for r, a in enumerate(self._ready_actors())]
        return self._wait(refs, method)[0]

    def _on_rank0(self, method: str, *args):
        # Reads of the model and config only (no collective), so the other ranks need not run it.
        return self._wait([self._ready_actors()[0].call.remote(method, True, *args)], method)[0]

    def _ready_actors(self) -> list:
        self._usable()
        return self._actors

    def _usable(self) -> None:
        if self._broken:
            raise RuntimeError(self._broken)

    def _wait(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """Every result, by rank; the first failure (after `grace_s` for the others) raised."""
        ray = _import_ray()
        ranks = ranks if ranks is not None else list(range(len(refs)))
        pending = dict(zip(refs, ranks, strict=True))
        results, errors, deadline = {}, {}, None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                break  # grace over: the rest are blocked on the failed rank
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except Exception as e:  # noqa: BLE001 - collected, raised below with its rank
                errors[rank] = e
                deadline = deadline or time.monotonic() + self.grace_s
        if errors:
            self._raise(errors, what, pending=bool(pending))
        return [results[r] for r in ranks]

    def _raise(self, errors: dict[int, BaseException], what: str, pending: bool):
        ray = _import_ray()
        rank = min(errors)
        error = errors[rank]
        cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
        text = next((line for line in str(cause).splitlines() if line.strip()), "")
        others = f" (ranks {sorted(errors)} failed)" if len(errors) > 1 else ""
        msg = f"{what} failed on rank {rank}: {type(cause).__name__}: {text}{others}"
        if pending:
            self._broken = (f"rank {rank} failed in {what} while other ranks were still in it; "
                            "call shutdown() and build a new RayPolicyGroup")
        raise RayGroupError(msg, rank, sorted(errors), cause) from errors[rank]


AHEAD = 2  # buckets rank 0 may produce before the driver has read them


def _device_index(gpu_ids: list[str], local_rank: int) -> int:
    """LOCAL_RANK for this rank's device: its GPU's index among the visible ones. Ray normally
    shows an actor only its own GPU (index 0); with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES it
    shows them all."""
    if not gpu_ids:
        return local_rank
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return int(gpu_ids[0])
    order = visible.split(",")
    return order.index(gpu_ids[0]) if gpu_ids[0] in order else 0


def _discard(bucket) -> None:
    pass


def _put(batch: RolloutBatch):
    # One copy in the object store that every rank reads, not one serialised per call.
    return _import_ray().put(batch)


def _gpus_per_rank(ray, cfg, gpus: float | None) -> float:
    if gpus is None:
        device = cfg.train.device
        has_gpus = device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        gpus = 1.0 if device == "cuda" or has_gpus else 0.0
    if not 0 <= gpus <= 1:
        raise ValueError(f"gpus_per_rank={gpus}: a rank drives one device; give a value in [0, 1]")
    return gpus


def _make_placement_group(ray, n: int, cpus: float, gpus: float, strategy: str, timeout_s: float):
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = ray.util.placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"{n} bundles of {bundle} could not be placed within {timeout_s:.0f}s: "
                           "the Ray cluster lacks them; lower num_ranks or the per-rank "
                           "resources, or add nodes") from None
    return pg


def _start_actors(ray, pg, n: int, cpus: float, gpus: float, env: dict[str, str] | None) -> list:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # "control": a thread of its own for stop_export, which must reach an export in progress;
    # every other method runs in the default group, one at a time, in call order.
    actor_cls = ray.remote(concurrency_groups={"control": 1})(_Rank)
    options = {"num_cpus": cpus, "num_gpus": gpus}
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return [actor_cls.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=rank)).remote(rank, n) for rank in range(n)]
