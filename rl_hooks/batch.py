"""RolloutBatch: the jagged contract between an RL framework and the trainer (one rollout batch).

Layout (THD, as in data_packing/batch.py, without padding): sequences (prompt then response) lie
one after another on a flat token axis of length T; sequence s occupies the positions
[cu_seqlens[s], cu_seqlens[s+1]). Every sequence has at least one token.

Alignment, stated once for every field of this package:
  * A per-token value at position t (rollout_logprobs, old_logprobs, ref_logprobs, advantages,
    loss_mask) is about token t as a *target*: logprob[t] = log p(tokens[t] | the tokens before t
    in its sequence), i.e. the model's output at position t-1 scored token t.
  * The first token of a sequence has nothing before it, so it has no such value: its per-token
    values are ignored (they must still be finite; 0 is the convention) and loss_mask there must be
    False.
  * routed_experts[t] are the experts token t itself was routed to, as the input of each MoE layer
    (the forward pass at position t, the one that scores token t+1), -1 where unknown.
  * Either the framework gives per-token `advantages`, or per-sequence `rewards` with `group_ids`
    and the trainer computes advantages (rl_hooks/advantages.py), never both.

Shapes: T tokens, S sequences, L MoE layers, K experts per token (top-k), N loss tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Float fields are refused in half precision: bf16 values near -5 are 0.03 apart, so exp(new - old),
# the importance ratio every policy loss is built on, would be off by a few percent.
FLOAT_DTYPES = (torch.float32, torch.float64)
CU_DTYPES = (torch.int32, torch.int64)
PER_TOKEN_FLOATS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages")
PER_TOKEN_FIELDS = ("tokens", "loss_mask", *PER_TOKEN_FLOATS, "routed_experts")
PER_SEQ_FIELDS = ("rewards", "group_ids")


class RolloutBatchError(ValueError):
    """A RolloutBatch breaks its contract; the one-line message names the field and the fix."""


def _fail(field: str, message: str) -> None:
    raise RolloutBatchError(f"RolloutBatch.{field}: {message}")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d) for d in dtypes)


def _check_vector(field: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...], length: int,
                  unit: str) -> None:
    """x must be 1-D with `length` elements of one of `dtypes` (unit: 'tokens' or 'sequences')."""
    if x.dtype not in dtypes:
        _fail(field, f"dtype is {x.dtype}; pass it as {_names(dtypes)}")
    if x.shape != (length,):
        _fail(field, f"shape is {tuple(x.shape)} but the batch has {length} {unit}; "
                     f"give one value per {unit[:-1]} as a flat ({length},) tensor")


def _check_finite(field: str, x: torch.Tensor, unit: str) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        hint = " (a sequence's first token has no logprob: put 0 there)" if unit == "token" else ""
        _fail(field, f"non-finite value {x[i].item()} at {unit} {i}; replace NaN/inf{hint}")


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # int64 [T]; prompt then response of each sequence, back to back
    cu_seqlens: torch.Tensor  # int32 or int64 [S+1]; 0, strictly increasing, T
    loss_mask: torch.Tensor  # bool [T]; True on response tokens that carry loss
    rollout_logprobs: torch.Tensor | None = None  # float [T]; from the inference engine
    old_logprobs: torch.Tensor | None = None  # float [T]; trainer's policy before this update
    ref_logprobs: torch.Tensor | None = None  # float [T]; reference policy (KL penalty)
    advantages: torch.Tensor | None = None  # float [T]; never together with rewards
    rewards: torch.Tensor | None = None  # float [S]; needs group_ids
    group_ids: torch.Tensor | None = None  # int64 [S]; arbitrary ids, same id = same prompt group
    routed_experts: torch.Tensor | None = None  # int16 [T, L, K]; -1 = unknown

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def seq_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def target_index(self) -> torch.Tensor:
        """int64 [N]: the flat positions t where loss_mask[t] is True, in increasing order."""
        return self.loss_mask.nonzero().view(-1)

    def seq_of_token(self) -> torch.Tensor:
        """int64 [T]: the index of the sequence each token belongs to."""
        cu = self.cu_seqlens.long()
        seqs = torch.arange(self.num_seqs, device=cu.device)
        return torch.repeat_interleave(seqs, cu[1:] - cu[:-1], output_size=self.num_tokens)

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if value is not None:
                moved[name] = value.to(device, non_blocking=True)
        return RolloutBatch(**moved)

    def select(self, seq_indices: list[int]) -> RolloutBatch:
        """A new batch holding the sequences `seq_indices` in that order (repeats allowed), every
        per-token and per-sequence field sliced to match; cu_seqlens keeps its dtype."""
        cu = self.cu_seqlens.long()
        idx_S = torch.as_tensor(seq_indices, dtype=torch.long, device=cu.device)
        starts_S, lens_S = cu[:-1][idx_S], (cu[1:] - cu[:-1])[idx_S]
        new_cu = torch.zeros(len(seq_indices) + 1, dtype=torch.long, device=cu.device)
        new_cu[1:] = lens_S.cumsum(0)
        total = int(new_cu[-1])
        # Source position of new token j: j shifted by (old start - new start) of its sequence.
        shift_T = torch.repeat_interleave(starts_S - new_cu[:-1], lens_S, output_size=total)
        src_T = torch.arange(total, device=cu.device) + shift_T
        picked = {"cu_seqlens": new_cu.to(self.cu_seqlens.dtype)}
        for name in PER_TOKEN_FIELDS + PER_SEQ_FIELDS:
            value = getattr(self, name)
            index = src_T if name in PER_TOKEN_FIELDS else idx_S
            picked[name] = None if value is None else value[index.to(value.device)]
        return RolloutBatch(**picked)

    @classmethod
    def concat(cls, batches: list[RolloutBatch]) -> RolloutBatch:
        """The sequences of `batches` back to back, in order (e.g. data-parallel shares gathered
        in rank order). An optional field must be set in every batch or in none."""
        picked: dict[str, torch.Tensor | None] = {}
        for name in PER_TOKEN_FIELDS + PER_SEQ_FIELDS:
            values = [getattr(b, name) for b in batches]
            given = [v is not None for v in values]
            if any(given) and not all(given):
                _fail(name, f"set in {sum(given)} of {len(values)} batches being joined; set it in "
                      "every batch or in none")
            picked[name] = torch.cat(values) if all(given) else None
        ends = torch.tensor([b.num_tokens for b in batches]).cumsum(0)
        cu = [batches[0].cu_seqlens.long()[:1]]
        cu += [b.cu_seqlens.long()[1:] + int(end - b.num_tokens) for b, end in zip(batches, ends, strict=True)]
        picked["cu_seqlens"] = torch.cat(cu).to(batches[0].cu_seqlens.dtype)
        return cls(**picked)

    @classmethod
    def from_sequences(cls, prompts: list[list[int]], responses: list[list[int]], *,
                       rewards: list[float] | None = None, group_ids: list[int] | None = None,
                       **per_response_token_fields: list[list[float]]) -> RolloutBatch:
        """Build a batch from per-sequence lists (CPU tensors; cu_seqlens int32, floats float32).

        Each sequence is prompts[s] + responses[s]; loss_mask is True exactly on the response.
        A keyword among rollout_logprobs/old_logprobs/ref_logprobs/advantages gives, per sequence,
        one float per response token, placed at the response positions (0 on the prompt).
        A prompt needs >= 1 token; a response may be empty. Call validate() on the result.
        """
        num_seqs = len(prompts)
        if len(responses) != num_seqs:
            _fail("responses", f"{len(responses)} responses for {num_seqs} prompts; give one each")
        for s, prompt in enumerate(prompts):
            if len(prompt) == 0:
                _fail("tokens", f"prompts[{s}] is empty; every sequence needs >= 1 prompt token")
        tokens, mask = [], []
        for prompt, response in zip(prompts, responses, strict=True):
            tokens += [*prompt, *response]
            mask += [False] * len(prompt) + [True] * len(response)
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        per_token = {name: _place_on_responses(name, values, prompts, responses)
                     for name, values in per_response_token_fields.items()}
        per_seq = {}
        if rewards is not None:
            per_seq["rewards"] = torch.tensor(rewards, dtype=torch.float32)
        if group_ids is not None:
            per_seq["group_ids"] = torch.tensor(group_ids, dtype=torch.int64)
        return cls(tokens=torch.tensor(tokens, dtype=torch.int64), cu_seqlens=cu,
                   loss_mask=torch.tensor(mask, dtype=torch.bool), **per_token, **per_seq)

    def validate(self, vocab_size: int, num_moe_layers: int | None = None,
                 top_k: int | None = None, num_experts: int | None = None) -> None:
        """Raise RolloutBatchError (a ValueError, one line naming the field and the fix) unless the
        batch meets the contract in the module docstring. Route dimensions and expert ids are
        checked only against the arguments given. Reads the tensors only; changes nothing."""
        self._check_tensors()
        self._check_layout()
        self._check_optional_fields()
        self._check_routes(num_moe_layers, top_k, num_experts)
        self._check_values(vocab_size)

    def _check_layout(self) -> None:
        """tokens, cu_seqlens and loss_mask: dtypes, shapes, non-empty, cu_seqlens bounds."""
        if self.tokens.dtype != torch.int64 or self.tokens.ndim != 1:
            _fail("tokens", f"is {self.tokens.dtype} of shape {tuple(self.tokens.shape)}; "
                            "pass a flat int64 [T] tensor")
        if self.num_tokens == 0:
            _fail("tokens", "the batch is empty (T == 0); give at least one sequence")
        cu = self.cu_seqlens
        if cu.dtype not in CU_DTYPES or cu.ndim != 1:
            _fail("cu_seqlens", f"is {cu.dtype} of shape {tuple(cu.shape)}; "
                                "pass a flat int32 or int64 [S+1] tensor")
        if cu.numel() < 2:
            _fail("cu_seqlens", "holds no sequence; give [0, end_0, ..., T] with S >= 1")
        if int(cu[0]) != 0 or int(cu[-1]) != self.num_tokens:
            _fail("cu_seqlens", f"runs from {int(cu[0])} to {int(cu[-1])}; it must start at 0 "
                                f"and end at T={self.num_tokens}")
        if bool((cu[1:] <= cu[:-1]).any()):
            s = int((cu[1:] <= cu[:-1]).nonzero()[0, 0])
            _fail("cu_seqlens", f"sequence {s} has {int(cu[s + 1] - cu[s])} tokens; offsets "
                                "must strictly increase (drop empty sequences)")
        _check_vector("loss_mask", self.loss_mask, (torch.bool,), self.num_tokens, "tokens")

    def _check_tensors(self) -> None:
        """Every field given is a tensor on the device of `tokens`."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not torch.is_tensor(value):
                _fail(f.name, f"is a {type(value).__name__}; pass a torch.Tensor "
                              "(RolloutBatch.from_sequences builds one from lists)")
            if value is not None and value.device != self.tokens.device:
                _fail(f.name, f"is on {value.device} but tokens are on {self.tokens.device}; "
                              "move the whole batch with .to(device)")

    def _check_optional_fields(self) -> None:
        """Per-token floats, rewards/group_ids: dtype, length, finiteness and pairing."""
        for name in PER_TOKEN_FLOATS:
            value = getattr(self, name)
            if value is not None:
                _check_vector(name, value, FLOAT_DTYPES, self.num_tokens, "tokens")
                _check_finite(name, value, "token")
        if self.advantages is not None and self.rewards is not None:
            _fail("advantages", "given together with rewards; give per-token advantages or "
                                "per-sequence rewards (+ group_ids), not both")
        if (self.rewards is None) != (self.group_ids is None):
            missing = "group_ids" if self.group_ids is None else "rewards"
            _fail(missing, "is missing; rewards and group_ids come together (one group id per "
                           "sequence, same id = samples of the same prompt)")
        if self.rewards is not None:
            _check_vector("rewards", self.rewards, FLOAT_DTYPES, self.num_seqs, "sequences")
            _check_finite("rewards", self.rewards, "sequence")
            _check_vector("group_ids", self.group_ids, (torch.int64,), self.num_seqs, "sequences")

    def _check_routes(self, num_moe_layers: int | None, top_k: int | None,
                      num_experts: int | None) -> None:
        routes = self.routed_experts
        if routes is None:
            return
        dims = [self.num_tokens, "L" if num_moe_layers is None else num_moe_layers,
                "K" if top_k is None else top_k]
        shape_ok = routes.ndim == 3 and routes.shape[0] == self.num_tokens
        shape_ok = shape_ok and num_moe_layers in (None, routes.shape[1])
        shape_ok = shape_ok and top_k in (None, routes.shape[2])
        if routes.dtype != torch.int16 or not shape_ok:
            _fail("routed_experts", f"is {routes.dtype} of shape {tuple(routes.shape)}; pass int16 "
                                    f"[T, L, K] = [{', '.join(map(str, dims))}] (-1 where unknown)")
        bad = routes < -1
        if num_experts is not None:
            bad |= routes >= num_experts
        if bool(bad.any()):
            t, layer, k = bad.nonzero()[0].tolist()
            allowed = f"in [-1, {num_experts})" if num_experts is not None else ">= -1"
            _fail("routed_experts", f"expert id {int(routes[t, layer, k])} at token {t}, MoE "
                                    f"layer {layer}, slot {k} is not {allowed}; use -1 for an "
                                    "unknown route")

    def _check_values(self, vocab_size: int) -> None:
        """Token ids in the vocabulary; loss only where a logprob exists, and somewhere."""
        bad = (self.tokens < 0) | (self.tokens >= vocab_size)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            _fail("tokens", f"id {int(self.tokens[t])} at token {t} is outside [0, {vocab_size}); "
                            "tokenize with the model's tokenizer or pass its vocab_size")
        first_T = self.cu_seqlens[:-1].long()
        on_first = self.loss_mask[first_T]
        if bool(on_first.any()):
            s = int(on_first.nonzero()[0, 0])
            _fail("loss_mask", f"is True on the first token of sequence {s} (token "
                               f"{int(first_T[s])}), which has no logprob; set it False there")
        if not bool(self.loss_mask.any()):
            _fail("loss_mask", "has no True token; give at least one response token with loss")


def _place_on_responses(name: str, values: list[list[float]], prompts: list[list[int]],
                        responses: list[list[int]]) -> torch.Tensor:
    """float32 [T]: per-response values at the response positions, 0 on the prompts."""
    if name not in PER_TOKEN_FLOATS:
        _fail(name, f"is not a per-token field; use one of {', '.join(PER_TOKEN_FLOATS)}")
    if len(values) != len(responses):
        _fail(name, f"has {len(values)} entries for {len(responses)} sequences; give one list "
                    "per response")
    flat = []
    for s, (prompt, response, vals) in enumerate(zip(prompts, responses, values, strict=True)):
        if len(vals) != len(response):
            _fail(name, f"[{s}] has {len(vals)} values for a {len(response)}-token response; "
                        "give one per response token")
        flat += [0.0] * len(prompt) + list(vals)
    return torch.tensor(flat, dtype=torch.float32)
