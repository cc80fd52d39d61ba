"""verl: `DataProto.batch` (a TensorDict) to a RolloutBatch, and per-token outputs back.

verl's layout, as its code builds it (verl/experimental/agent_loop/agent_loop.py `_postprocess`,
verl/workers/actor/dp_actor.py `_forward_micro_batch`, commit b178a3c of 2026-01-29):

    input_ids, attention_mask, position_ids   [B, P+R]  prompts left-padded to P, responses
                                                        right-padded to R, concatenated
    responses, response_mask                  [B, R]    input_ids[:, -R:]; response_mask is 0 on
                                                        padding and on tokens without loss (tool
                                                        output in multi-turn rollouts)
    old_log_probs, ref_log_prob,              [B, R]    aligned to response tokens:
    rollout_log_probs, advantages                       old_log_probs[:, j] = log p(responses[:, j]
                                                        | prompt, responses[:, :j]) (dp_actor
                                                        slices logits[:, -R-1:-1])
    routed_experts                            [B, P+R, L, K]  the experts of each input token,
                                                        0 at padding (router replay, R3)

Our alignment is the same per token (the value at a position scores that position's token), so
each real token keeps its value; only padding is dropped.

verl 0.9's trainer hands its engines a no-padding TensorDict instead (verl/workers/utils/padding.py
`left_right_2_no_padding`): input_ids and position_ids become nested (jagged) [B, j] over each
row's real tokens, the [B, R] response fields stay padded, and the engine's per-token outputs are
nested [B, j] SHIFTED by one: log_probs[b][i] scores input_ids[b][i + 1] (the engines label
position i with the next token; `no_padding_2_padding` reads a response's values from the
position before each token). `from_verl` reads both layouts; `logprobs_to_verl_nested` and
`nested_to_ours` convert per-token values between the shifted nested layout and ours.

Routes: verl writes 0 where the rollout engine reported no route, which is also expert 0, so
`routed_experts` needs `routes_known` (bool, True where reported) and unknown routes become -1.
`rollout_is_weights` (verl's truncated importance weights) has no RolloutBatch field: it is
refused (the verl engine applies it through verl's own loss). position_ids must be verl's
`compute_position_id_with_mask` (0, 1, ... over each row's real tokens): the trainer derives
positions from the sequence boundaries and cannot honour others (mrope position_ids [B, 3, S]
of vision models are refused).

Legend: B rows, P padded prompt length, R padded response length, S = P + R, T real tokens.
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

NAME = "verl"
# verl field -> RolloutBatch field; every one [B, R], aligned to response tokens
FLOAT_FIELDS = {"old_log_probs": "old_logprobs", "ref_log_prob": "ref_logprobs",
                "rollout_log_probs": "rollout_logprobs", "advantages": "advantages"}


def _fields(data: Any) -> Mapping:
    """A DataProto's `.batch` TensorDict, or the mapping itself."""
    return data.batch if hasattr(data, "batch") and not isinstance(data, Mapping) else data


def _layout(fields: Mapping) -> tuple[torch.Tensor, int]:
    """keep_BS (bool [B, P+R], the real tokens) and R, after checking the padding is verl's."""
    input_ids = get(fields, NAME, "input_ids")
    if input_ids.ndim != 2:
        fail(NAME, "input_ids", f"has shape {tuple(input_ids.shape)}; expected [B, P+R]")
    rows, width = input_ids.shape
    responses = get(fields, NAME, "responses")
    if responses.ndim != 2 or responses.shape[0] != rows or responses.shape[1] > width - 1:
        fail(NAME, "responses", f"has shape {tuple(responses.shape)}; expected [B, R] with "
                                f"B={rows} and R < {width} (input_ids is [B, P+R])")
    r = responses.shape[1]
    mask = get(fields, NAME, "attention_mask")
    check_shape(NAME, "attention_mask", mask, (rows, width))
    keep_BS = check_binary(NAME, "attention_mask", mask)
    prompt, response = keep_BS[:, :width - r].int(), keep_BS[:, width - r:].int()
    # Left-padded prompt: 0 ... 0 1 ... 1; right-padded response: 1 ... 1 0 ... 0.
    if bool((prompt[:, 1:] < prompt[:, :-1]).any()):
        b = int((prompt[:, 1:] < prompt[:, :-1]).any(1).nonzero()[0, 0])
        fail(NAME, "attention_mask", f"row {b}: the prompt part is not left-padded (0s then 1s)")
    if bool((response[:, 1:] > response[:, :-1]).any()):
        b = int((response[:, 1:] > response[:, :-1]).any(1).nonzero()[0, 0])
        fail(NAME, "attention_mask", f"row {b}: the response part is not right-padded (1s then 0s)")
    if not bool(prompt[:, -1].all()):
        b = int((prompt[:, -1] == 0).nonzero()[0, 0])
        fail(NAME, "attention_mask", f"row {b} has an empty prompt; every row needs >= 1 "
                                     "prompt token")
    tail = input_ids[:, width - r:]
    if bool(((tail != responses) & keep_BS[:, width - r:]).any()):
        b = int(((tail != responses) & keep_BS[:, width - r:]).any(1).nonzero()[0, 0])
        fail(NAME, "responses", f"row {b} differs from input_ids[:, -R:] on real tokens; "
                                "input_ids must be prompts then responses")
    return keep_BS, r


def _check_positions(fields: Mapping, keep_BS: torch.Tensor) -> None:
    pos = get(fields, NAME, "position_ids", required=False)
    if pos is None:
        return
    if pos.shape != keep_BS.shape:
        fail(NAME, "position_ids", f"has shape {tuple(pos.shape)}; only text position ids "
                                   f"[B, P+R] = {tuple(keep_BS.shape)} are supported (not mrope)")
    expected = keep_BS.long().cumsum(1) - 1
    if bool(((pos != expected) & keep_BS).any()):
        b = int(((pos != expected) & keep_BS).any(1).nonzero()[0, 0])
        fail(NAME, "position_ids", f"row {b} is not 0, 1, ... over its real tokens; the trainer "
                                   "numbers positions per sequence and cannot take others")


def _on_full_width(x_BR: torch.Tensor, width: int) -> torch.Tensor:
    """A [B, R, ...] response field at the response columns of a [B, P+R, ...] zero tensor."""
    out = torch.zeros((x_BR.shape[0], width, *x_BR.shape[2:]), dtype=x_BR.dtype, device=x_BR.device)
    out[:, width - x_BR.shape[1]:] = x_BR
    return out


def from_verl(data: Any, *, rewards: Sequence[float] | torch.Tensor | None = None,
              group_ids: Sequence[Hashable] | None = None,
              routes_known: torch.Tensor | None = None) -> RolloutBatch:
    """A RolloutBatch from a verl DataProto (or its `.batch` / a dict of the same tensors).

    Left padding of prompts and right padding of responses are stripped with attention_mask;
    loss_mask = response_mask on response tokens (attention_mask[:, -R:] when response_mask is
    absent, as verl's compute_response_mask does). Optional per-sequence `rewards` [B] with
    `group_ids` [B] (any hashables, e.g. `data.non_tensor_batch["uid"]`) for GRPO advantages.
    `routes_known`: bool [B, P+R] (nested [B, j] for a no-padding TensorDict), needed with
    routed_experts. Raises AdapterError (one line naming the verl field)."""
    fields = _fields(data)
    _refuse_is_weights(fields)
    if _nested(fields):
        return _from_nested(fields, rewards, group_ids, routes_known)
    keep_BS, r = _layout(fields)
    rows, width = keep_BS.shape
    _check_positions(fields, keep_BS)
    resp_mask = get(fields, NAME, "response_mask", required=False)
    if resp_mask is None:
        resp_mask = keep_BS[:, width - r:]
    check_shape(NAME, "response_mask", resp_mask, (rows, r))
    resp_mask = check_binary(NAME, "response_mask", resp_mask)
    if bool((resp_mask & ~keep_BS[:, width - r:]).any()):
        fail(NAME, "response_mask", "is 1 on response padding (attention_mask 0 there); it must "
                                    "be 0 wherever attention_mask is")
    floats = {}
    for name, ours in FLOAT_FIELDS.items():
        x = get(fields, NAME, name, required=False)
        if x is not None:
            check_shape(NAME, name, x, (rows, r))
            check_float(NAME, name, x)
            floats[ours] = _on_full_width(x, width)
    routes = get(fields, NAME, "routed_experts", required=False)
    if routes is not None and (routes.ndim != 4 or routes.shape[:2] != (rows, width)):
        fail(NAME, "routed_experts", f"has shape {tuple(routes.shape)}; expected "
                                     f"[B, P+R, L, K] with B={rows}, P+R={width}")
    if routes is not None:
        routes = _unknown_routes(routes, routes_known, (rows, width))
    groups = None if group_ids is None else group_index(NAME, group_ids, rows)
    return flatten(keep_BS, get(fields, NAME, "input_ids"), _on_full_width(resp_mask, width),
                   floats, routes, rewards, groups)


def _to_response_columns(name: str, values_T: torch.Tensor, data: Any) -> torch.Tensor:
    keep_BS, r = _layout(_fields(data))
    return unflatten(NAME, name, values_T, keep_BS)[:, keep_BS.shape[1] - r:]


def logprobs_to_verl(out: Any, data: Any) -> torch.Tensor:
    """out.logprobs [T] (compute_logprobs on from_verl(data)) as verl's old_log_probs: [B, R] in
    out's dtype, [:, j] = log p(responses[:, j] | ...), 0 at response padding."""
    return _to_response_columns("out.logprobs", out.logprobs, data)


def entropy_to_verl(out: Any, data: Any) -> torch.Tensor:
    """out.entropy [T] as verl's entropys [B, R]: the entropy of the distribution that scored
    responses[:, j] (0 at padding). compute_logprobs(..., return_entropy=True) gives it."""
    if out.entropy is None:
        fail(NAME, "out.entropy", "is None; call compute_logprobs(..., return_entropy=True)")
    return _to_response_columns("out.entropy", out.entropy, data)


def routes_to_verl(out: Any, data: Any) -> torch.Tensor:
    """out.routes [T, L, K] as verl's routed_experts [B, P+R, L, K] (int16, 0 at padding as verl's
    agent loop pads them). compute_logprobs(..., record_routes=True) gives them."""
    if out.routes is None:
        fail(NAME, "out.routes", "is None; call compute_logprobs(..., record_routes=True)")
    keep_BS, _ = _layout(_fields(data))
    return unflatten(NAME, "out.routes", out.routes, keep_BS)


# ---------------------------------------------------------------- routes, IS weights


def _refuse_is_weights(fields: Mapping) -> None:
    if "rollout_is_weights" in fields and fields["rollout_is_weights"] is not None:
        fail(NAME, "rollout_is_weights", "has no RolloutBatch field; pass rollout_log_probs with "
                                         "PolicyLossConfig.tis_cap / icepop, or train through the "
                                         "verl engine (verl's loss applies it)")


def _unknown_routes(routes: torch.Tensor, known: torch.Tensor | None, shape: tuple) -> torch.Tensor:
    """routes with -1 where `known` is False (verl's 0 there would read as expert 0)."""
    if known is None:
        fail(NAME, "routed_experts", "comes without routes_known; verl writes 0 for routes the "
                                     "rollout engine did not report, which reads as expert 0: pass "
                                     "routes_known=<bool mask, True where reported>")
    if known.is_nested:
        known = known.values()
    if tuple(known.shape) != tuple(shape):
        fail(NAME, "routes_known", f"has shape {tuple(known.shape)}; expected {tuple(shape)}, the "
                                   "routed_experts positions")
    known = check_binary(NAME, "routes_known", known)
    return torch.where(known[..., None, None], routes.long(), torch.full_like(routes.long(), -1))


# ---------------------------------------------------------------- the no-padding TensorDict


def _nested(fields: Mapping) -> bool:
    ids = fields["input_ids"] if "input_ids" in fields else None
    return torch.is_tensor(ids) and ids.is_nested


def response_lengths(fields: Mapping) -> torch.Tensor:
    """int64 [B]: each row's response tokens, as verl's no_padding_2_padding counts them."""
    prompts, responses = get(fields, NAME, "prompts"), get(fields, NAME, "responses")
    if responses.is_nested:
        return responses.offsets().diff()
    mask = get(fields, NAME, "attention_mask")
    if mask.ndim != 2 or mask.shape[1] != prompts.shape[1] + responses.shape[1]:
        fail(NAME, "attention_mask", f"has shape {tuple(mask.shape)}; expected [B, P+R] with "
                                     f"P={prompts.shape[1]}, R={responses.shape[1]}")
    return mask[:, prompts.shape[1]:].sum(1).long()


def _response_index(cu: torch.Tensor, resp_B: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """(row b, column j, flat token t) of every real response token j < resp_B[b]."""
    rows = torch.arange(resp_B.numel()).repeat_interleave(resp_B)
    first = torch.repeat_interleave(resp_B.cumsum(0) - resp_B, resp_B)
    cols = torch.arange(int(resp_B.sum())) - first
    return rows, cols, cu[1:][rows] - resp_B[rows] + cols


def _from_nested(fields: Mapping, rewards, group_ids, routes_known) -> RolloutBatch:
    ids = fields["input_ids"]
    cu = ids.offsets().long().cpu()
    tokens_T = ids.values().long()
    rows = cu.numel() - 1
    resp_B = response_lengths(fields).cpu()
    if bool((cu[1:] - cu[:-1] <= resp_B).any()):
        b = int((cu[1:] - cu[:-1] <= resp_B).nonzero()[0, 0])
        fail(NAME, "input_ids", f"row {b} has no prompt token; every row needs >= 1")
    mask = get(fields, NAME, "response_mask")
    mask = mask.to_padded_tensor(0) if mask.is_nested else mask
    check_shape(NAME, "response_mask", mask, (rows,))
    b_N, j_N, t_N = _response_index(cu, resp_B, mask.shape[1])
    loss_T = torch.zeros(tokens_T.numel(), dtype=torch.bool, device=tokens_T.device)
    loss_T[t_N] = check_binary(NAME, "response_mask", mask)[b_N, j_N].to(loss_T.device)
    extra = {}
    for name, ours in FLOAT_FIELDS.items():
        x = get(fields, NAME, name, required=False)
        if x is not None:
            x = x.to_padded_tensor(0.0) if x.is_nested else x
            check_shape(NAME, name, x, (rows, mask.shape[1]))
            check_float(NAME, name, x)
            extra[ours] = x.new_zeros(tokens_T.numel()).index_put((t_N,), x[b_N, j_N])
    routes = get(fields, NAME, "routed_experts", required=False)
    if routes is not None:
        routes = routes.values() if routes.is_nested else routes
        extra["routed_experts"] = _unknown_routes(routes, routes_known,
                                                  (tokens_T.numel(),)).to(torch.int16)
    if rewards is not None:
        extra["rewards"] = torch.as_tensor(rewards, dtype=torch.float32)
    if group_ids is not None:
        extra["group_ids"] = group_index(NAME, group_ids, rows)
    return RolloutBatch(tokens=tokens_T, cu_seqlens=cu.to(tokens_T.device), loss_mask=loss_T,
                        **extra)


def ours_to_nested(values_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Our per-token values [T, ...] (value at t scores token t, 0 at first tokens) as verl's
    shifted nested [B, j, ...] (value at i scores token i + 1; 0 at each row's last position).
    Differentiable: verl's loss functions backpropagate through it."""
    cu = cu_seqlens.long().to(values_T.device)
    shifted = torch.roll(values_T, -1, 0).index_fill(0, cu[1:] - 1, 0)
    return torch.nested.nested_tensor_from_jagged(shifted, offsets=cu)


def nested_to_ours(values: torch.Tensor) -> torch.Tensor:
    """verl's shifted nested per-token values [B, j] back to our flat [T] alignment."""
    if not values.is_nested:
        fail(NAME, "log_probs", f"is a dense {tuple(values.shape)} tensor; expected verl's nested "
                                "[B, j] per-token output")
    flat, cu = values.values(), values.offsets().long()
    return torch.roll(flat, 1, 0).index_fill(0, cu[:-1], 0)


def logprobs_to_verl_nested(out: Any, data: Any) -> torch.Tensor:
    """out.logprobs [T] (compute_logprobs on from_verl(no-padding data)) as the nested [B, j]
    log_probs a verl engine returns (shifted; see the module docstring)."""
    return ours_to_nested(out.logprobs, _fields(data)["input_ids"].offsets())


def entropy_to_verl_nested(out: Any, data: Any) -> torch.Tensor:
    """out.entropy [T] as verl's nested [B, j] entropy (shifted like log_probs)."""
    if out.entropy is None:
        fail(NAME, "out.entropy", "is None; call compute_logprobs(..., return_entropy=True)")
    return ours_to_nested(out.entropy, _fields(data)["input_ids"].offsets())


# ---------------------------------------------------------------- metrics

# PolicyTrainer.train_step keys -> the names verl's actor reports (before the trainer's "actor/").
VERL_METRIC_NAMES = {"policy_loss": "pg_loss", "clip_frac": "pg_clipfrac", "approx_kl": "ppo_kl",
                     "entropy": "entropy", "kl": "kl_loss", "grad_norm": "grad_norm", "lr": "lr",
                     "loss": "loss", "dual_clip_frac": "pg_clipfrac_lower"}


def metrics_to_verl(metrics: Mapping[str, Any]) -> dict[str, list[float]]:
    """train_step's metrics as verl's trainer logs them: "actor/<name>" -> one value per
    optimizer step (verl.utils.metric.reduce_metrics takes the mean, or max / min for keys that
    contain "max" / "min"). verl's names where verl has the metric, ours otherwise."""
    steps = metrics.get("steps")
    if not isinstance(steps, list) or not steps:
        fail(NAME, "metrics", "has no 'steps' list; pass the dict PolicyTrainer.train_step returned")
    return {f"actor/{VERL_METRIC_NAMES.get(k, k)}": [float(s[k]) for s in steps] for k in steps[0]}


# ---------------------------------------------------------------- loss settings

LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo"}
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _verl_key(actor: Any, key: str, default: Any = None) -> Any:
    return actor.get(key, default) if hasattr(actor, "get") else getattr(actor, key, default)


def loss_config_from_verl(actor: Any, num_seqs: int) -> tuple[Any, dict[str, int]]:
    """verl's actor loss settings (its ActorConfig or the `actor_rollout_ref.actor` mapping) as
    (PolicyLossConfig, {"mini_batches", "epochs"}) for a batch of `num_seqs` sequences, so that
    `policy.train_step(batch, make_loss(cfg), **steps)` computes verl's ppo_loss: clip_ratio_low /
    high (clip_ratio when unset), clip_ratio_c (verl's vanilla loss always applies its dual clip),
    loss_agg_mode, use_kl_loss / kl_loss_coef / kl_loss_type (low_var_kl = our k3, clamped to
    +-10 as verl does), entropy_coeff, ppo_epochs, ppo_mini_batch_size x rollout_n. Settings with
    no exact counterpart raise AdapterError naming the key."""
    from rl_hooks.losses import PolicyLossConfig

    policy_loss = _verl_key(actor, "policy_loss") or {}
    mode = _verl_key(policy_loss, "loss_mode", "vanilla")
    if mode not in LOSS_MODES:
        fail(NAME, "policy_loss.loss_mode", f"{mode!r} has no counterpart here; use one of "
                                            f"{', '.join(LOSS_MODES)}, or train through the verl engine")
    agg = _verl_key(actor, "loss_agg_mode", "token-mean")
    if agg not in AGGS:
        fail(NAME, "loss_agg_mode", f"{agg!r}: verl divides by loss_scale_factor or the padded "
                                    f"response width, which a RolloutBatch has not; use one of {', '.join(AGGS)}")
    if _verl_key(actor, "loss_scale_factor") is not None:
        fail(NAME, "loss_scale_factor", "has no counterpart; leave it unset (null)")
    kl_type = _verl_key(actor, "kl_loss_type", "low_var_kl")
    use_kl = bool(_verl_key(actor, "use_kl_loss", False))
    if use_kl and kl_type not in KL_TYPES:
        fail(NAME, "kl_loss_type", f"{kl_type!r} has no counterpart; use one of {', '.join(KL_TYPES)}")
    clip = _verl_key(actor, "clip_ratio", 0.2)
    low, high = _verl_key(actor, "clip_ratio_low"), _verl_key(actor, "clip_ratio_high")
    cfg = PolicyLossConfig(kind=LOSS_MODES[mode], agg=agg,
                           eps_low=clip if low is None else low, eps_high=clip if high is None else high,
                           dual_clip=_verl_key(actor, "clip_ratio_c", 3.0) if mode == "vanilla" else None,
                           kl_coef=float(_verl_key(actor, "kl_loss_coef", 0.0)) if use_kl else 0.0,
                           kl_type=KL_TYPES.get(kl_type, "k3"),
                           entropy_coef=float(_verl_key(actor, "entropy_coeff", 0.0)))
    per_step = int(_verl_key(actor, "ppo_mini_batch_size")) * int(_verl_key(actor, "rollout_n", 1))
    if per_step <= 0 or num_seqs % per_step:
        fail(NAME, "ppo_mini_batch_size", f"{per_step} sequences per mini-batch (x rollout_n) do not "
                                          f"divide the batch's {num_seqs}; verl needs them to")
    return cfg, {"mini_batches": num_seqs // per_step, "epochs": int(_verl_key(actor, "ppo_epochs", 1))}
