"""verl's split-training worker (TinkerTrainingWorker, verl 0.9.1) driving the longctx_moe engine:
optimizer_zero_grad, forward_backward on each half of the batch, then one optimizer_step. The
gradients of the two calls add up before the step; each call's loss is normalised by its own
half's tokens, as verl sets it. Reference: our single-device model scored by verl's functions, the
two halves' ppo_loss summed, one AdamW step (float64: only the summation order differs, 1e-10)."""

from __future__ import annotations

import traceback
from functools import partial

import pytest
import torch

from tests.launcher import run_distributed
from tests.rl_hooks import verl_cases as vc
from tests.rl_hooks.test_verl_engine import _hf_from_export, _our_logits

pytest.importorskip("verl")

TOL = 1e-10


def _split_pass(rank: int, world: int, folder: str, layout: list[str], budget: int) -> dict:
    from tensordict import NonTensorData
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker
    from verl.workers.utils.losses import ppo_loss

    worker = TinkerTrainingWorker(vc.worker_config(folder, "float64", layout, budget))
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=vc.actor_config()))
    data = vc.padded_batch()
    worker.optimizer_zero_grad()
    log_probs, losses = [], []
    for half in range(2):
        whole = vc.share(data, half, 2)
        n = whole.batch_size[0] // world  # this DP rank's chunk of the half
        td = tu.index_select_tensor_dict(data, list(range(half * 2 * n + rank * n, half * 2 * n + (rank + 1) * n)))
        tu.assign_non_tensor(td, calculate_entropy=True, temperature=1.0, global_batch_size=whole.batch_size[0],
                             global_token_num=NonTensorData(whole["input_ids"].offsets().diff().tolist()))
        out = worker.forward_backward(td)
        log_probs += [x.clone() for x in tu.get(out, "log_probs").unbind()]
        losses.append(tu.get(out, "metrics")["loss"])
    metrics = worker.optimizer_step()
    export = {n: t.clone() for n, t in worker.engine.get_per_tensor_param()[0]}
    return {"log_probs": log_probs, "losses": losses, "grad_norm": metrics["grad_norm"],
            "export": export if rank == 0 else None}


def _split_passes(rank: int, world: int, passes: list[tuple]) -> list:
    """`_split_pass` for each of `passes` in this rank's one process (verl imported and the group
    joined once for them all); a pass that raises gives its traceback in its place."""
    out = []
    for args in passes:
        try:
            out.append(_split_pass(rank, world, *args))
        except Exception:  # noqa: BLE001 - reported by the test of this pass
            out.append(f"rank {rank}: {traceback.format_exc()}")
    return out


def _reference(folder):
    """Per-row log-probs, the halves' losses, and the HF state dict after one AdamW step on the
    sum of the two halves' losses."""
    from longctx_moe.hf.interop import to_hf_state_dict

    model, logits_of = _our_logits(folder, "float64")
    data = vc.padded_batch()
    rows, losses = [], []
    for half in range(2):
        lps, _, loss = vc.reference(logits_of, vc.share(data, half, 2), vc.actor_config())
        loss.backward()
        rows += lps
        losses.append(float(loss.detach()))
    torch.optim.AdamW(model.parameters(), lr=vc.LR, eps=vc.EPS, weight_decay=0.0).step()
    return rows, losses, {k: v.detach() for k, v in to_hf_state_dict(model).items()}


# (our layout, verl's max_token_len_per_gpu): DP2; Dynamic-CP over the two DP ranks, where the
# 8-token budget sends the longer sequences to runs over both ranks (the training pass's
# log-probs of a share then come from runs anywhere in the block).
LAYOUTS = {"dp2": ([], 32), "dp2-dynamic-cp": (["parallel.dynamic_cp=true", "parallel.max_cp=2"], 8)}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory) -> dict:
    """case -> (its HF folder, each rank's `_split_pass` result): both layouts in one 2-rank run."""
    folders = {case: vc.save_hf_model(tmp_path_factory.mktemp(case) / "hf", "float64") for case in sorted(LAYOUTS)}
    passes = [(str(folders[case]), *LAYOUTS[case]) for case in folders]
    per_rank = run_distributed(_split_passes, world_size=2, args=(passes,), timeout=600)
    return {case: (folders[case], [r[i] for r in per_rank]) for i, case in enumerate(folders)}


@pytest.mark.slow  # two gloo ranks
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_tinker_worker_accumulates_two_forward_backward_calls_into_one_step(tmp_path, split_runs, case):
    """On DP2: each call's gradients are summed over the ranks before they join the earlier
    call's (summing the earlier, already reduced ones again would double them)."""
    folder, runs = split_runs[case]
    failed = [run for run in runs if isinstance(run, str)]
    assert not failed, failed[0]
    rows, losses, after = _reference(folder)
    # each half's rows: its first DP chunk (rank 0), then the second (rank 1)
    got_rows = [row for h in range(2) for run in runs for row in run["log_probs"][2 * h:2 * h + 2]]
    for i, (got, want) in enumerate(zip(got_rows, rows, strict=True)):
        assert float(got[-1]) == 0.0 and float((got[:-1] - want).abs().max()) <= TOL, f"row {i}"
    run = runs[0]
    for got, want in zip(run["losses"], losses, strict=True):
        # verl sums a call's micro-batch losses as a float32 tensor: ~1e-7 relative whatever the
        # engine's precision (the float64 weights below are the exact check)
        assert abs(got - want) <= max(TOL, 1e-7 * abs(want))
    assert run["grad_norm"] > 0
    got = _hf_from_export(run["export"], folder, tmp_path / "export", "float64").state_dict()
    assert set(got) == set(after)
    for name, want in after.items():
        err = float((got[name].double() - want.double()).abs().max())
        assert err <= 10 * TOL, f"{name}: updated weights differ by {err:.3g}"
