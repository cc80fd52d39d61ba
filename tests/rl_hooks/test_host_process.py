"""A PolicyTrainer, the verl engine and the NeMo-RL worker live in processes an RL framework made:
building and running them leaves that process's CPU settings as they were, unless the config asks
(train.host_tuning=full, an explicit train.num_threads or train.host_allocator). `longctx-moe train`
owns its process and tunes it all.

What is observed, in a fresh interpreter per case (the settings are process-wide and would leak
into other tests):
- denormals: whether a float32 denormal survives a multiply (flush-to-zero makes it 0);
- torch's intra-op and inter-op thread counts;
- malloc: every mallopt call of the project goes through longctx_moe.host._mallopt (checked over
  the source below), which the child wraps to record calls; and M_ARENA_MAX=1 as glibc shows it:
  a new thread's allocations open no arena of their own (malloc_info's heap count);
- the whole os.environ (oneDNN's cache variables included).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl_hooks.helpers import SETS as POLICY_SETS

ROOT = Path(__file__).resolve().parents[2]
# The helpers' config without its explicit host settings: the defaults are what is under test.
BARE = [s for s in POLICY_SETS if not s.startswith(("train.num_threads=", "train.host_allocator="))]
# The frameworks' test configs (configs/tiny_cpu.yaml, verl_cases) name one thread and plain
# glibc; these overrides, last, bring back the defaults.
UNSET = ["train.num_threads=0", "train.host_allocator=auto"]
ONEDNN = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"}


# ---------------------------------------------------------------------- in the child process


def _arenas() -> int:
    """glibc's malloc arenas (malloc_info's <heap> entries)."""
    import ctypes
    import ctypes.util
    import tempfile

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile("r") as out:
        f = libc.fopen(out.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
        return len(re.findall(r"<heap nr=", out.read()))


def _new_thread_opens_an_arena() -> bool:
    import threading

    import torch

    before = _arenas()

    def work():
        blocks = [bytearray(200_000) for _ in range(8)]  # noqa: F841 - malloc'd by this thread
        torch.ones(64, 64).sum()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return _arenas() > before


def _state() -> dict:
    import torch

    return {"env": dict(os.environ), "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "flushes_denormals": float(torch.tensor([1e-40], dtype=torch.float32) * 1.0) == 0.0}


def _build_policy(sets: str) -> None:
    from longctx_moe.config import load_config
    from rl_hooks import PolicyLossConfig, PolicyTrainer, make_loss
    from tests.rl_hooks.helpers import rollout_batch

    policy = PolicyTrainer(load_config(None, json.loads(sets)), micro_batch_tokens=24)
    batch = rollout_batch()
    policy.compute_logprobs(batch)
    policy.train_step(batch, make_loss(PolicyLossConfig(kind="ppo")))


def _build_frameworks(folder: str) -> None:
    """verl's engine as its EngineRegistry builds it, then NeMo-RL's policy worker."""
    from verl.workers.engine import EngineRegistry

    from rl_hooks.plugins.nemo_rl import LongctxMoePolicyWorker
    from tests.rl_hooks import verl_cases as vc
    from tests.rl_hooks.test_nemo_rl_worker import policy_config

    cfg = vc.worker_config(Path(folder), "float64", UNSET)
    EngineRegistry.new(model_type=cfg.model_type, backend=cfg.engine_config.strategy,
                       model_config=cfg.model_config, engine_config=cfg.engine_config,
                       optimizer_config=cfg.optimizer_config, checkpoint_config=cfg.checkpoint_config)
    nemo = policy_config(folder)
    nemo["longctx_moe"]["overrides"] += UNSET
    LongctxMoePolicyWorker(nemo, init_reference_model=False)


def _start_train_run(sets: str) -> None:
    """`longctx-moe train`'s run (train.run) up to where it builds the data and model."""
    import contextlib

    from longctx_moe import train
    from longctx_moe.config import load_config

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    train.start_up = stop
    with contextlib.suppress(Stop):
        train.run(load_config(None, json.loads(sets)))


def child(case: str, arg: str) -> None:
    """Run `case` between two observations; print them, and the host lines `case` printed, as
    JSON (the last line of stdout)."""
    import contextlib
    import io

    from longctx_moe import host

    calls = []
    mallopt = host._mallopt

    def recording_mallopt(param, value):
        calls.append([param, value])
        return mallopt(param, value)

    host._mallopt = recording_mallopt
    prepare = {"frameworks": _prepare_frameworks}.get(case)
    arg = prepare(arg) if prepare else arg
    before = _state()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        {"policy": _build_policy, "frameworks": _build_frameworks, "train": _start_train_run}[case](arg)
    after = _state()
    lines = [line for line in printed.getvalue().splitlines() if line.startswith("host:")]
    print(json.dumps({"before": before, "after": after, "mallopt": calls, "host_lines": lines,
                      "new_thread_arena": _new_thread_opens_an_arena()}))


def _prepare_frameworks(folder: str) -> str:
    """The HF model both frameworks start from, and their imports (transformers and verl set
    what they set at import: that is theirs, not the engine's)."""
    import verl.workers.engine  # noqa: F401

    import rl_hooks.plugins.nemo_rl  # noqa: F401
    import rl_hooks.plugins.verl  # noqa: F401
    from tests.rl_hooks import verl_cases as vc

    return str(vc.save_hf_model(Path(folder), "float64"))


# ---------------------------------------------------------------------- the tests


def _run(case: str, arg: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN}  # as a framework's fresh worker
    code = f"from tests.rl_hooks.test_host_process import child; child({case!r}, {arg!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_untouched(seen: dict) -> None:
    before, after = seen["before"], seen["after"]
    changed = {k for k in before["env"].keys() | after["env"].keys() if before["env"].get(k) != after["env"].get(k)}
    assert not changed, f"os.environ changed: {sorted(changed)}"
    assert (after["threads"], after["interop_threads"]) == (before["threads"], before["interop_threads"])
    assert not before["flushes_denormals"] and not after["flushes_denormals"]
    assert seen["mallopt"] == []
    assert seen["new_thread_arena"]  # M_ARENA_MAX left at glibc's default (many arenas)
    assert seen["host_lines"] == []


def test_every_mallopt_goes_through_the_one_watched_function():
    """The mallopt observation below covers the project: no other call site exists."""
    sites = [(p, line) for pkg in ("data_packing", "cp_attention", "longctx_moe", "rl_hooks")
             for p in sorted((ROOT / pkg).rglob("*.py"))
             for line in p.read_text().splitlines() if re.search(r"\.mallopt\(", line)]
    assert [(p.relative_to(ROOT).as_posix(), line.strip()) for p, line in sites] == \
        [("longctx_moe/host.py", "return bool(_libc().mallopt(param, value))")]


def test_policy_trainer_leaves_its_process_as_found():
    _assert_untouched(_run("policy", json.dumps(BARE)))


def test_policy_trainer_sets_only_what_the_config_names():
    seen = _run("policy", json.dumps([*BARE, "train.num_threads=1"]))
    before, after = seen["before"], seen["after"]
    assert after["threads"] == 1 and after["env"] == before["env"] and not after["flushes_denormals"]
    assert seen["mallopt"] == [] and seen["new_thread_arena"]
    assert seen["host_lines"] == ["host: 1 intra-op thread (set explicitly by train.num_threads; "
                                  "train.host_tuning=auto leaves the rest of this process as it was)"]
    seen = _run("policy", json.dumps([*BARE, "train.host_allocator=lean"]))
    assert [p for p, _ in seen["mallopt"]] == [-3, -1, -2, -8]  # mmap, trim, top pad, arena max
    assert seen["mallopt"][0][1] == 1 << 20 and not seen["new_thread_arena"]
    assert seen["after"]["threads"] == seen["before"]["threads"]
    assert seen["after"]["env"] == seen["before"]["env"] and not seen["after"]["flushes_denormals"]


def test_policy_trainer_tunes_the_host_when_asked():
    seen = _run("policy", json.dumps([*BARE, "train.host_tuning=full", "train.num_threads=1"]))
    after = seen["after"]
    assert after["threads"] == 1 and after["flushes_denormals"]
    assert {k: after["env"][k] for k in ONEDNN} == {k: "512" for k in ONEDNN}
    assert len(seen["mallopt"]) == 4 and not seen["new_thread_arena"]
    [line] = seen["host_lines"]
    assert line.startswith("host: 1 intra-op thread, denormals flushed to zero, glibc malloc tuned")
    assert line.endswith("(train.host_tuning=full)")


def test_train_tunes_its_own_process_and_says_so_in_one_line():
    seen = _run("train", json.dumps(["train.num_threads=1"]))
    after = seen["after"]
    assert after["threads"] == 1 and after["flushes_denormals"]
    assert {k: after["env"][k] for k in ONEDNN} == {k: "512" for k in ONEDNN}
    assert len(seen["mallopt"]) == 4 and not seen["new_thread_arena"]
    assert seen["host_lines"] == [
        "host: 1 intra-op thread, denormals flushed to zero, glibc malloc tuned (mmap above 32 MiB, trim "
        "above 1 GiB, one arena), ONEDNN_PRIMITIVE_CACHE_CAPACITY=512, LRU_CACHE_CAPACITY=512 "
        "(train.host_tuning=auto: `longctx-moe train` tunes its own process)"]


def test_verl_engine_and_nemo_rl_worker_leave_their_process_as_found(tmp_path):
    pytest.importorskip("verl")
    _assert_untouched(_run("frameworks", str(tmp_path / "hf")))
