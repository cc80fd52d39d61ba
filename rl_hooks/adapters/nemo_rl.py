"""NeMo-RL: a `BatchedDataDict` of a GRPO train batch to a RolloutBatch, and log-probs back.

NeMo-RL's layout, as its code builds it (nemo_rl/algorithms/grpo.py `_build_async_grpo_train_data`,
nemo_rl/algorithms/loss/loss_functions.py `ClippedPGLossFn`, nemo_rl/models/automodel/train.py
get_logprobs, nemo_rl/models/megatron/router_replay.py; commit 7ea279a of 2026-08-22):

    input_ids                       [B, S]  right-padded; row b has input_lengths[b] real tokens
    input_lengths                   [B]
    token_mask                      [B, S]  1 on tokens with loss (generated tokens)
    sample_mask                     [B]     0 drops a whole sample from the loss
    prev_logprobs, generation_logprobs,     [B, S]  the value at t = log p(input_ids[:, t] | < t),
    reference_policy_logprobs, advantages           position 0 = 0 (get_logprobs prepends a zero;
                                                    the loss reads [:, 1:] of each, token_mask too)
    routed_experts                  [B, S, L, K]  router replay, -1 where unknown

That is our alignment exactly, so real tokens keep their values and only the right padding goes.
token_mask[:, 0] is ignored, as NeMo-RL's loss ignores it. sample_mask is a 0/1 multiplier here;
loss_mask = token_mask & sample_mask.

Legend: B rows, S padded length, T real tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from rl_hooks.adapters._common import (
    check_binary,
    check_float,
    check_shape,
    fail,
    flatten,
    get,
    group_index,
    unflatten,
)
from rl_hooks.batch import RolloutBatch

NAME = "NeMo-RL"
FLOAT_FIELDS = {"prev_logprobs": "old_logprobs", "generation_logprobs": "rollout_logprobs",
                "reference_policy_logprobs": "ref_logprobs", "advantages": "advantages"}


def real_tokens(data: Mapping) -> torch.Tensor:
    """bool [B, S]: the first input_lengths[b] positions of each row."""
    input_ids = get(data, NAME, "input_ids")
    if input_ids.ndim != 2:
        fail(NAME, "input_ids", f"has shape {tuple(input_ids.shape)}; expected [B, S]")
    rows, width = input_ids.shape
    lengths = get(data, NAME, "input_lengths")
    if lengths.shape != (rows,):
        fail(NAME, "input_lengths", f"has shape {tuple(lengths.shape)}; expected [B] = ({rows},)")
    if bool(((lengths < 1) | (lengths > width)).any()):
        b = int(((lengths < 1) | (lengths > width)).nonzero()[0, 0])
        fail(NAME, "input_lengths", f"row {b} has length {int(lengths[b])}; each must be in "
                                    f"[1, {width}] (S of input_ids)")
    cols = torch.arange(width, device=input_ids.device)
    return cols[None, :] < lengths.to(input_ids.device)[:, None]


def from_nemo_rl(data: Mapping, *, rewards: Sequence[float] | torch.Tensor | None = None,
                 group_ids: Sequence[Hashable] | None = None) -> RolloutBatch:
    """A RolloutBatch from a NeMo-RL BatchedDataDict (or a dict of the same tensors).

    Right padding is stripped with input_lengths; loss_mask = token_mask & sample_mask. Optional
    per-sequence `rewards` with `group_ids` when the batch brings no advantages. Raises
    AdapterError (one line naming the NeMo-RL field)."""
    keep_BS = real_tokens(data)
    rows, width = keep_BS.shape
    token_mask = get(data, NAME, "token_mask")
    check_shape(NAME, "token_mask", token_mask, (rows, width))
    loss_BS = check_binary(NAME, "token_mask", token_mask)
    if bool((loss_BS & ~keep_BS).any()):
        b = int((loss_BS & ~keep_BS).any(1).nonzero()[0, 0])
        fail(NAME, "token_mask", f"row {b} is 1 past input_lengths[{b}]; padding carries no loss")
    sample = get(data, NAME, "sample_mask", required=False)
    if sample is not None:
        check_shape(NAME, "sample_mask", sample, (rows,))
        loss_BS = loss_BS & check_binary(NAME, "sample_mask", sample).to(loss_BS.device)[:, None]
    floats = {}
    for name, ours in FLOAT_FIELDS.items():
        x = get(data, NAME, name, required=False)
        if x is not None:
            check_shape(NAME, name, x, (rows, width))
            check_float(NAME, name, x)
            floats[ours] = x
    routes = get(data, NAME, "routed_experts", required=False)
    if routes is not None and (routes.ndim != 4 or routes.shape[:2] != (rows, width)):
        fail(NAME, "routed_experts", f"has shape {tuple(routes.shape)}; expected [B, S, L, K] "
                                     f"with B={rows}, S={width}")
    groups = None if group_ids is None else group_index(NAME, group_ids, rows)
    return flatten(keep_BS, get(data, NAME, "input_ids"), loss_BS, floats, routes, rewards, groups)


def logprobs_to_nemo_rl(out: Any, data: Mapping) -> torch.Tensor:
    """out.logprobs [T] (compute_logprobs on from_nemo_rl(data)) as NeMo-RL's get_logprobs
    returns them: [B, S] in out's dtype, position 0 and padding 0."""
    return unflatten(NAME, "out.logprobs", out.logprobs, real_tokens(data))


def entropy_to_nemo_rl(out: Any, data: Mapping) -> torch.Tensor:
    """out.entropy [T] in the same [B, S] layout (0 at position 0 and padding)."""
    if out.entropy is None:
        fail(NAME, "out.entropy", "is None; call compute_logprobs(..., return_entropy=True)")
    return unflatten(NAME, "out.entropy", out.entropy, real_tokens(data))


def routes_to_nemo_rl(out: Any, data: Mapping) -> torch.Tensor:
    """out.routes [T, L, K] as NeMo-RL's routed_experts [B, S, L, K] (int16, -1 at padding)."""
    if out.routes is None:
        fail(NAME, "out.routes", "is None; call compute_logprobs(..., record_routes=True)")
    return unflatten(NAME, "out.routes", out.routes, real_tokens(data), fill=-1)
