"""`longctx-pack --ray ADDRESS`: build the shards of one output as Ray tasks (extra `ray`).

The driver opens the inputs, trains or loads the tokenizer and picks the shard count exactly as a
local run does (`pipeline.prepare`); each unfinished shard is then one task, built by the same
code as locally (`pipeline.build_shard`), on whichever node Ray places it; the driver writes
metadata.json once every task has returned (`pipeline.finish`). The bytes are those of a local
run with the same inputs, seed and shard count. Inputs and the output directory must be visible
at the same paths on every node (a shared filesystem), as for `--shard-index` jobs.
"""

from __future__ import annotations

import time
from dataclasses import replace

from data_packing import pipeline
from data_packing.pipeline import PackArgs
from data_packing.tokenizer import thread_env


def _build(run: pipeline.Run, k: int) -> dict:
    return pipeline.build_shard(run, k)


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'longctx-moe[ray]' (or drop --ray to pack "
                         "in this process)") from None
    return ray


def pack_on_ray(a: PackArgs, address: str | None = None) -> dict:
    """Like `pipeline.pack`, with one Ray task per shard. address: None joins the Ray instance
    this process already started (or RAY_ADDRESS, else a local one, as `ray.init()` does);
    "local" starts a local instance with --workers CPUs; anything else is passed to ray.init."""
    ray = _ray()
    run, done = pipeline.prepare(a)
    if done is not None:
        return done
    todo = run.todo()
    started = not ray.is_initialized()
    if started:
        if address == "local":
            ray.init(num_cpus=a.workers, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    t1 = time.perf_counter()
    try:
        # Each task builds its shard in one process: the cluster's CPUs are the parallelism.
        shipped = ray.put(replace(run, args=replace(run.args, workers=1, progress=False)))
        # one tokenizer thread per task, set through Ray for the task's own worker process
        task = ray.remote(num_cpus=1, runtime_env={"env_vars": thread_env(1)})(_build)
        built = ray.get([task.remote(shipped, k) for k in todo])
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, ValueError | FileExistsError | OSError):
            raise type(cause)(str(cause)) from None
        raise
    finally:
        if started:
            ray.shutdown()
    return pipeline.finish(run, built, time.perf_counter() - t1)
