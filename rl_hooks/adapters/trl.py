"""TRL: the output of a GRPOTrainer `rollout_func` to a RolloutBatch, and log-probs back.

TRL's contract, as its code states it (trl 1.16.0, trl/trainer/grpo_trainer.py: the
`rollout_func` docstring and `_generate` / `_generate_and_score_completions`):

    prompt_ids      list of B token lists, one per completion (a prompt repeated for each of its
                    num_generations completions, consecutively)
    completion_ids  list of B token lists
    logprobs        list of B float lists, one per completion token: the sampler's
                    log p(completion[j] | prompt, completion[:j]), or None (no sampler log-probs)
    env_mask        optional list of B 0/1 lists per completion token: 1 = model token, 0 = tokens
                    an environment inserted (no loss)

TRL pads prompts left and completions right itself and scores completion token j at logits
position -C-1+j (its `logits_to_keep` slice), i.e. per completion token, as ours. Groups: the
trainer gives the completions of one prompt consecutive rows, so `num_generations` = G makes
rows [iG, (i+1)G) one group. Advantages in TRL are one per completion.

Legend: B completions, C longest completion, T tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from rl_hooks.adapters._common import fail, group_index
from rl_hooks.batch import RolloutBatch

NAME = "TRL"


def _lists(output: Mapping, name: str, rows: int | None, required: bool = True):
    value = output.get(name)
    if value is None:
        if required:
            fail(NAME, name, "is missing; rollout_func must return it")
        return None
    if not isinstance(value, Sequence) or isinstance(value, str):
        fail(NAME, name, f"is a {type(value).__name__}; pass a list with one list per completion")
    if rows is not None and len(value) != rows:
        fail(NAME, name, f"has {len(value)} entries for {rows} completions; give one each")
    return [list(v) for v in value]


def _per_token(output: Mapping, name: str, completions: list[list[int]]):
    values = _lists(output, name, len(completions), required=False)
    if values is None:
        return None
    for b, (vals, comp) in enumerate(zip(values, completions, strict=True)):
        if len(vals) != len(comp):
            fail(NAME, name, f"[{b}] has {len(vals)} values for a {len(comp)}-token completion")
        if any(v is None for v in vals):
            # vLLM reports a NaN log-prob as None; our batch needs a finite value there.
            fail(NAME, name, f"[{b}] holds None (a NaN from vLLM); drop that completion or "
                             "mask it with env_mask and put 0")
    return values


def _groups(rows: int, num_generations: int | None, group_ids) -> torch.Tensor:
    if group_ids is not None:
        return group_index(NAME, group_ids, rows)
    if num_generations is None:
        fail(NAME, "group_ids", "is missing with rewards; pass num_generations (GRPOTrainer's "
                                "consecutive groups) or group_ids")
    if num_generations < 1 or rows % num_generations:
        fail(NAME, "num_generations", f"{num_generations} does not divide the {rows} completions")
    return torch.arange(rows, dtype=torch.int64) // num_generations


def from_trl(output: Mapping, *, rewards: Sequence[float] | None = None,
             num_generations: int | None = None, group_ids: Sequence[Hashable] | None = None,
             advantages: Sequence[float] | None = None,
             dtype: torch.dtype = torch.float32) -> RolloutBatch:
    """A RolloutBatch of one sequence per completion (prompt_ids[b] + completion_ids[b]).

    `logprobs` become rollout_logprobs; loss_mask is True on completion tokens (times env_mask).
    Either per-completion `rewards` (grouped by `num_generations` or `group_ids`) or
    per-completion `advantages` (placed on every completion token). Floats in `dtype`.
    Raises AdapterError (one line naming the TRL field)."""
    prompts = _lists(output, "prompt_ids", None)
    completions = _lists(output, "completion_ids", len(prompts))
    for b, p in enumerate(prompts):
        if not p:
            fail(NAME, "prompt_ids", f"[{b}] is empty; every completion needs >= 1 prompt token")
    logps = _per_token(output, "logprobs", completions)
    env = _per_token(output, "env_mask", completions)
    tokens, loss, lp, adv = [], [], [], []
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens += p + c
        mask = [True] * len(c) if env is None else [bool(m) for m in env[b]]
        loss += [False] * len(p) + mask
        lp += [0.0] * len(p) + (logps[b] if logps is not None else [0.0] * len(c))
        if advantages is not None:
            adv += [0.0] * len(p) + [float(advantages[b])] * len(c)
    lengths = torch.tensor([0] + [len(p) + len(c) for p, c in zip(prompts, completions,
                                                                  strict=True)])
    extra = {}
    if logps is not None:
        extra["rollout_logprobs"] = torch.tensor(lp, dtype=dtype)
    if advantages is not None:
        if len(advantages) != len(prompts):
            fail(NAME, "advantages", f"has {len(advantages)} entries for {len(prompts)} "
                                     "completions; give one per completion")
        extra["advantages"] = torch.tensor(adv, dtype=dtype)
    if rewards is not None:
        if len(rewards) != len(prompts):
            fail(NAME, "rewards", f"has {len(rewards)} entries for {len(prompts)} completions")
        extra["rewards"] = torch.tensor(list(rewards), dtype=dtype)
        extra["group_ids"] = _groups(len(prompts), num_generations, group_ids)
    return RolloutBatch(tokens=torch.tensor(tokens, dtype=torch.int64),
                        cu_seqlens=lengths.cumsum(0), loss_mask=torch.tensor(loss), **extra)


def _completion_slices(output: Mapping) -> list[tuple[int, int]]:
    prompts = _lists(output, "prompt_ids", None)
    completions = _lists(output, "completion_ids", len(prompts))
    spans, start = [], 0
    for p, c in zip(prompts, completions, strict=True):
        spans.append((start + len(p), start + len(p) + len(c)))
        start += len(p) + len(c)
    return spans


def _to_completions(name: str, values_T: torch.Tensor, output: Mapping, padded: bool):
    spans = _completion_slices(output)
    total = spans[-1][1] if spans else 0
    if values_T.shape[0] != total:
        fail(NAME, name, f"has {values_T.shape[0]} tokens but the completions and prompts have "
                         f"{total}; pass compute_logprobs of from_trl(output)")
    if not padded:
        return [values_T[a:b].tolist() for a, b in spans]
    width = max((b - a for a, b in spans), default=0)
    out = torch.zeros(len(spans), width, dtype=values_T.dtype, device=values_T.device)
    for row, (a, b) in enumerate(spans):
        out[row, :b - a] = values_T[a:b]
    return out


def logprobs_to_trl(out: Any, output: Mapping, padded: bool = False):
    """out.logprobs [T] of from_trl(output) per completion token: a list of B float lists
    (the `logprobs` layout of rollout_func), or with padded=True a [B, C] tensor right-padded
    with 0 (the layout of GRPOTrainer's old_per_token_logps)."""
    return _to_completions("out.logprobs", out.logprobs, output, padded)


def entropy_to_trl(out: Any, output: Mapping, padded: bool = False):
    """out.entropy [T] in the same per-completion layout as logprobs_to_trl."""
    if out.entropy is None:
        fail(NAME, "out.entropy", "is None; call compute_logprobs(..., return_entropy=True)")
    return _to_completions("out.entropy", out.entropy, output, padded)
