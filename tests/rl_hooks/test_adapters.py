"""Adapters from verl / NeMo-RL / TRL batch layouts to RolloutBatch and back.

Neither verl nor NeMo-RL is installed here (both pull GPU stacks), so their batches are built as
plain dicts of tensors in the layout their code builds (verl `DataProto.batch` from
agent_loop._postprocess, NeMo-RL's GRPO train BatchedDataDict; see the module docstrings of
rl_hooks/adapters/verl.py and nemo_rl.py), one sample at a time, independently of the adapter.
TRL's rollout_func output is plain lists by its own contract; where trl is importable, the
padded layout is also checked against trl's own `pad`.

Every comparison is exact except against the model, where float64 summation order differs
(~1e-15 measured in test_policy.py; 1e-10 would still catch a token off by one position).
"""

from __future__ import annotations

import pytest
import torch

from rl_hooks import PolicyTrainer, RolloutBatch
from rl_hooks.adapters import (
    AdapterError,
    entropy_to_nemo_rl,
    entropy_to_trl,
    entropy_to_verl,
    from_nemo_rl,
    from_trl,
    from_verl,
    logprobs_to_nemo_rl,
    logprobs_to_trl,
    logprobs_to_verl,
    routes_to_nemo_rl,
    routes_to_verl,
)
from rl_hooks.api import LogProbs
from tests.rl_hooks.helpers import EXPERTS, LAYERS, TOP_K, VOCAB, config
from tests.rl_hooks.test_policy import reference_logprobs

TOL = 1e-10
NAN = float("nan")  # in padding: a value that leaks from padding into the batch fails loudly
# Prompts 1-11 tokens (different left padding), responses 0-7 (a 1-token and an empty one).
SHAPES = [(5, 1), (1, 7), (9, 3), (2, 1), (4, 0), (3, 6), (1, 1), (11, 2), (6, 5)]
FLOATS = ("old_logprobs", "ref_logprobs", "rollout_logprobs", "advantages")


def _samples(seed=0):
    """Per-sample prompts, responses, per-response-token float64 values and per-token routes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p, r in SHAPES:
        out.append({"prompt": torch.randint(0, VOCAB, (p,), generator=gen).tolist(),
                    "response": torch.randint(0, VOCAB, (r,), generator=gen).tolist(),
                    **{f: (torch.randn(r, generator=gen, dtype=torch.float64) - 3.9).tolist()
                       for f in FLOATS},
                    "routes": torch.randint(-1, EXPERTS, (p + r, LAYERS, TOP_K), generator=gen)})
    return out


def _reference(samples, routes=True) -> RolloutBatch:
    batch = RolloutBatch.from_sequences([s["prompt"] for s in samples],
                                        [s["response"] for s in samples])
    for f in FLOATS:  # float64 values placed on response tokens, 0 on prompts
        batch.__dict__[f] = torch.tensor([v for s in samples
                                          for v in [0.0] * len(s["prompt"]) + s[f]],
                                         dtype=torch.float64)
    if routes:
        batch.routed_experts = torch.cat([s["routes"] for s in samples]).to(torch.int16)
    return batch


def _verl(samples, routes=True) -> dict:
    """verl's DataProto.batch: prompts left-padded to P, responses right-padded to R."""
    b, p_max = len(samples), max(len(s["prompt"]) for s in samples)
    r_max = max(len(s["response"]) for s in samples)
    d = {"input_ids": torch.full((b, p_max + r_max), 7),
         "attention_mask": torch.zeros(b, p_max + r_max, dtype=torch.long),
         "responses": torch.full((b, r_max), 7),
         "response_mask": torch.zeros(b, r_max, dtype=torch.long),
         **{v: torch.full((b, r_max), NAN, dtype=torch.float64) for v in
            ("old_log_probs", "ref_log_prob", "rollout_log_probs", "advantages")},
         # verl pads routes with 0; 3 here shows a leak of padding into the batch
         "routed_experts": torch.full((b, p_max + r_max, LAYERS, TOP_K), 3, dtype=torch.long)}
    names = {"old_log_probs": "old_logprobs", "ref_log_prob": "ref_logprobs",
             "rollout_log_probs": "rollout_logprobs", "advantages": "advantages"}
    for i, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        d["input_ids"][i, p_max - p:p_max + r] = torch.tensor(s["prompt"] + s["response"])
        d["attention_mask"][i, p_max - p:p_max + r] = 1
        d["responses"][i, :r] = torch.tensor(s["response"], dtype=torch.long)
        d["response_mask"][i, :r] = 1
        for theirs, ours in names.items():
            d[theirs][i, :r] = torch.tensor(s[ours], dtype=torch.float64)
        d["routed_experts"][i, p_max - p:p_max + r] = s["routes"]
    # verl's compute_position_id_with_mask
    d["position_ids"] = torch.clip(d["attention_mask"].cumsum(1) - 1, min=0)
    if not routes:
        del d["routed_experts"]
    return d


def _nemo(samples, routes=True) -> dict:
    """NeMo-RL's train BatchedDataDict: right-padded [B, S], value at t scores token t."""
    b, s_max = len(samples), max(len(s["prompt"]) + len(s["response"]) for s in samples)
    d = {"input_ids": torch.full((b, s_max), 7), "input_lengths": torch.zeros(b, dtype=torch.long),
         "token_mask": torch.zeros(b, s_max), "sample_mask": torch.ones(b),
         **{v: torch.full((b, s_max), NAN, dtype=torch.float64) for v in
            ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "advantages")},
         "routed_experts": torch.full((b, s_max, LAYERS, TOP_K), -1, dtype=torch.long)}
    names = {"prev_logprobs": "old_logprobs", "generation_logprobs": "rollout_logprobs",
             "reference_policy_logprobs": "ref_logprobs", "advantages": "advantages"}
    for i, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        d["input_ids"][i, :p + r] = torch.tensor(s["prompt"] + s["response"])
        d["input_lengths"][i] = p + r
        d["token_mask"][i, p:p + r] = 1
        for theirs, ours in names.items():
            d[theirs][i, :p + r] = torch.tensor([0.0] * p + s[ours], dtype=torch.float64)
        d["routed_experts"][i, :p + r] = s["routes"]
    if not routes:
        del d["routed_experts"]
    return d


def _trl(samples) -> dict:
    return {"prompt_ids": [s["prompt"] for s in samples],
            "completion_ids": [s["response"] for s in samples],
            "logprobs": [s["rollout_logprobs"] for s in samples]}


def _assert_same(got: RolloutBatch, want: RolloutBatch, fields=FLOATS + ("routed_experts",)):
    got.validate(VOCAB, LAYERS, TOP_K, EXPERTS)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.cu_seqlens.tolist() == want.cu_seqlens.tolist()
    assert torch.equal(got.loss_mask, want.loss_mask)
    for f in fields:
        assert getattr(got, f).dtype == getattr(want, f).dtype, f
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def _fake_out(num_tokens, seed=1) -> LogProbs:
    gen = torch.Generator().manual_seed(seed)
    routes = torch.randint(0, EXPERTS, (num_tokens, LAYERS, TOP_K), generator=gen)
    return LogProbs(torch.randn(num_tokens, generator=gen, dtype=torch.float64),
                    torch.rand(num_tokens, generator=gen, dtype=torch.float64),
                    routes.to(torch.int16))


def _set(name, index, value):
    return lambda d: d[name].__setitem__(index, value)


def _edit(name, fn):
    return lambda d: d.__setitem__(name, fn(d[name]))


def _ids(errors):
    return [f"{e[0]}-{e[2]}" for e in errors]


def _zero_padded(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([x, torch.zeros(width - x.numel(), dtype=x.dtype)])


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(((got - want).abs() <= TOL).all())


def _per_sample(samples, values_T):
    """values_T cut per sample: (prompt part, response part), directly from the lengths."""
    out, start = [], 0
    for s in samples:
        p, r = len(s["prompt"]), len(s["response"])
        out.append((values_T[start:start + p], values_T[start + p:start + p + r]))
        start += p + r
    return out


# ---------------------------------------------------------------- verl


def test_verl_round_trip():
    samples = _samples()
    fields = _verl(samples)
    _assert_same(from_verl(fields, routes_known=_reported(fields)), _reference(samples))
    want = _reference(samples)
    out = _fake_out(want.num_tokens)
    r_max = fields["responses"].shape[1]
    got_lp, got_ent = logprobs_to_verl(out, fields), entropy_to_verl(out, fields)
    got_routes = routes_to_verl(out, fields)
    p_max = fields["input_ids"].shape[1] - r_max
    for i, ((_, lp), (_, ent), (rp, rr)) in enumerate(zip(
            _per_sample(samples, out.logprobs), _per_sample(samples, out.entropy),
            _per_sample(samples, out.routes), strict=True)):
        r = lp.numel()
        assert torch.equal(got_lp[i], torch.cat([lp, torch.zeros(r_max - r, dtype=lp.dtype)]))
        assert torch.equal(got_ent[i], torch.cat([ent, torch.zeros(r_max - r, dtype=ent.dtype)]))
        assert torch.equal(got_routes[i, p_max - rp.shape[0]:p_max + r], torch.cat([rp, rr]))
        assert int(got_routes[i, :p_max - rp.shape[0]].abs().sum()) == 0


def test_verl_multi_turn_response_mask_and_groups():
    """Tool-output tokens inside a response: attention 1, response_mask 0 -> kept, no loss.
    uid strings as group ids (verl's non_tensor_batch["uid"])."""
    samples = _samples()
    fields = _verl(samples, routes=False)
    fields["response_mask"][1, 2:4] = 0  # response of 7 tokens
    fields.pop("advantages")
    uids = ["a", "a", "b", "b", "c", "c", "a", "d", "d"]
    batch = from_verl(fields, rewards=[float(i) for i in range(9)], group_ids=uids)
    want = _reference(samples, routes=False)
    start = int(want.cu_seqlens[1]) + 1  # sample 1: prompt of 1 token
    want.loss_mask[start + 2:start + 4] = False
    assert torch.equal(batch.loss_mask, want.loss_mask)
    assert batch.tokens.tolist() == want.tokens.tolist()
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 0, 3, 3]
    assert batch.rewards.tolist() == [float(i) for i in range(9)]
    batch.validate(VOCAB)


def _reported(fields) -> torch.Tensor:
    """routes_known: every real token's routes were reported by the rollout engine."""
    return fields["attention_mask"].bool()


class _DataProto:
    """The two attributes of verl's DataProto the adapter reads (verl is not installed)."""

    def __init__(self, batch):
        self.batch, self.non_tensor_batch, self.meta_info = batch, {}, {}


def test_verl_accepts_a_data_proto_like_object():
    samples = _samples()
    fields = _verl(samples)
    _assert_same(from_verl(_DataProto(fields), routes_known=_reported(fields)), _reference(samples))


VERL_ERRORS = [
    ("attention_mask", _set("attention_mask", (0, 0), 1), "left-padded"),
    ("attention_mask", _set("attention_mask", (0, -1), 1), "right-padded"),
    ("attention_mask", _set("attention_mask", (2, 0), 2), "0 and 1"),
    ("responses", _set("responses", (1, 0), VOCAB), "differs"),  # response 1 has 7 tokens
    ("response_mask", _set("response_mask", (0, -1), 1), "padding"),
    ("old_log_probs", _edit("old_log_probs", lambda x: x[:, :-1]), "shape"),
    ("old_log_probs", _edit("old_log_probs", lambda x: x.bfloat16()), "bf16"),
    ("position_ids", _set("position_ids", (1, -1), 0), "not 0, 1"),
    ("routed_experts", _edit("routed_experts", lambda x: x[:, 1:]), "shape"),
    ("input_ids", lambda d: d.pop("input_ids"), "missing"),
]


@pytest.mark.parametrize("field,corrupt,words", VERL_ERRORS, ids=_ids(VERL_ERRORS))
def test_verl_malformed_input_names_the_field(field, corrupt, words):
    fields = _verl(_samples())
    corrupt(fields)
    with pytest.raises(AdapterError, match=f"^verl field '{field}': .*{words}") as err:
        from_verl(fields, routes_known=_reported(fields) if "attention_mask" in fields else None)
    assert "\n" not in str(err.value)


def test_verl_empty_prompt_and_wrong_output_length():
    fields = _verl(_samples())
    fields["attention_mask"][1, :fields["input_ids"].shape[1] - fields["responses"].shape[1]] = 0
    with pytest.raises(AdapterError, match="field 'attention_mask': row 1 has an empty prompt"):
        from_verl(fields)
    fields = _verl(_samples())
    with pytest.raises(AdapterError, match="verl field 'out.logprobs': has 3 tokens"):
        logprobs_to_verl(_fake_out(3), fields)


# ---------------------------------------------------------------- NeMo-RL


def test_nemo_rl_round_trip():
    samples = _samples()
    data = _nemo(samples)
    _assert_same(from_nemo_rl(data), _reference(samples))
    out = _fake_out(_reference(samples).num_tokens)
    got_lp, got_ent = logprobs_to_nemo_rl(out, data), entropy_to_nemo_rl(out, data)
    got_routes = routes_to_nemo_rl(out, data)
    width = data["input_ids"].shape[1]
    for i, ((lp_p, lp_r), (e_p, e_r), (r_p, r_r)) in enumerate(zip(
            _per_sample(samples, out.logprobs), _per_sample(samples, out.entropy),
            _per_sample(samples, out.routes), strict=True)):
        n = lp_p.numel() + lp_r.numel()
        assert torch.equal(got_lp[i], _zero_padded(torch.cat([lp_p, lp_r]), width))
        assert torch.equal(got_ent[i], _zero_padded(torch.cat([e_p, e_r]), width))
        assert torch.equal(got_routes[i, :n], torch.cat([r_p, r_r]))
        assert bool((got_routes[i, n:] == -1).all())


def test_nemo_rl_sample_mask_and_first_token():
    """sample_mask 0 drops a row's loss; token_mask at position 0 is ignored (NeMo-RL's loss
    reads token_mask[:, 1:])."""
    samples = _samples()
    data = _nemo(samples, routes=False)
    data["sample_mask"][2] = 0
    data["token_mask"][:, 0] = 1
    batch = from_nemo_rl(data)
    want = _reference(samples, routes=False)
    cu = want.cu_seqlens.tolist()
    want.loss_mask[cu[2]:cu[3]] = False
    assert torch.equal(batch.loss_mask, want.loss_mask)
    batch.validate(VOCAB)


NEMO_ERRORS = [
    ("input_lengths", _set("input_lengths", 0, 0), r"\[1, "),
    ("input_lengths", _set("input_lengths", 0, 99), r"\[1, "),
    ("token_mask", _set("token_mask", (0, -1), 1), "past input_lengths"),
    ("sample_mask", _set("sample_mask", 0, 0.5), "0 and 1"),
    ("prev_logprobs", _edit("prev_logprobs", lambda x: x.half()), "bf16"),
    ("advantages", _edit("advantages", lambda x: x[1:]), "shape"),
    ("routed_experts", _edit("routed_experts", lambda x: x[..., 0]), "shape"),
    ("token_mask", lambda d: d.pop("token_mask"), "missing"),
]


@pytest.mark.parametrize("field,corrupt,words", NEMO_ERRORS, ids=_ids(NEMO_ERRORS))
def test_nemo_rl_malformed_input_names_the_field(field, corrupt, words):
    data = _nemo(_samples())
    corrupt(data)
    with pytest.raises(AdapterError, match=f"^NeMo-RL field '{field}': .*{words}") as err:
        from_nemo_rl(data)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- TRL


def test_trl_round_trip_and_groups():
    samples = _samples()
    output = _trl(samples)
    batch = from_trl(output, rewards=[0.5] * 9, num_generations=3, dtype=torch.float64)
    _assert_same(batch, _reference(samples), fields=("rollout_logprobs",))
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    adv = from_trl(output, advantages=[float(i) for i in range(9)], dtype=torch.float64)
    assert adv.advantages.tolist() == [
        v for i, s in enumerate(samples)
        for v in [0.0] * len(s["prompt"]) + [float(i)] * len(s["response"])]
    out = _fake_out(batch.num_tokens)
    got, got_ent = logprobs_to_trl(out, output), entropy_to_trl(out, output)
    padded = logprobs_to_trl(out, output, padded=True)
    c_max = max(len(s["response"]) for s in samples)
    for i, ((_, lp), (_, ent)) in enumerate(zip(_per_sample(samples, out.logprobs),
                                                _per_sample(samples, out.entropy), strict=True)):
        assert got[i] == lp.tolist() and got_ent[i] == ent.tolist()
        assert torch.equal(padded[i], _zero_padded(lp, c_max))
    trl_utils = pytest.importorskip("trl.trainer.utils")
    # GRPOTrainer pads per-token sampler log-probs with trl's own pad (right, value 0)
    theirs = trl_utils.pad([torch.tensor(x, dtype=torch.float64) for x in got],
                           padding_value=0.0, padding_side="right")
    assert torch.equal(padded, theirs)


def test_trl_env_mask():
    samples = _samples()
    output = _trl(samples) | {"env_mask": [[1] * len(s["response"]) for s in samples]}
    output["env_mask"][1][3] = 0
    batch = from_trl(output)
    want = _reference(samples, routes=False)
    want.loss_mask[int(want.cu_seqlens[1]) + 1 + 3] = False
    assert torch.equal(batch.loss_mask, want.loss_mask)


TRL_ERRORS = [
    ("logprobs", lambda o: o["logprobs"][1].pop(), "6 values for a 7-token"),
    ("logprobs", lambda o: o["logprobs"][1].__setitem__(0, None), "None"),
    ("completion_ids", lambda o: o["completion_ids"].pop(), "8 entries for 9"),
    ("prompt_ids", lambda o: o["prompt_ids"].__setitem__(0, []), "empty"),
    ("prompt_ids", lambda o: o.pop("prompt_ids"), "missing"),
]


@pytest.mark.parametrize("field,corrupt,words", TRL_ERRORS, ids=_ids(TRL_ERRORS))
def test_trl_malformed_input_names_the_field(field, corrupt, words):
    output = _trl(_samples())
    corrupt(output)
    with pytest.raises(AdapterError, match=f"^TRL field '{field}': .*{words}"):
        from_trl(output)


def test_trl_groups_need_num_generations_or_ids():
    output = _trl(_samples())
    with pytest.raises(AdapterError, match="TRL field 'group_ids': is missing"):
        from_trl(output, rewards=[0.0] * 9)
    with pytest.raises(AdapterError, match="TRL field 'num_generations': 4 does not divide"):
        from_trl(output, rewards=[0.0] * 9, num_generations=4)


# ---------------------------------------------------------------- through the model


@pytest.fixture(scope="module")
def policy():
    return PolicyTrainer(config(), micro_batch_tokens=24)


def test_compute_logprobs_in_each_framework_layout_equals_each_sample_alone(policy):
    """compute_logprobs on each adapted batch, put back in the framework's layout, against each
    sample through the model alone (full logits), placed by hand."""
    samples = _samples()
    want_lp, want_ent = reference_logprobs(policy.runtime.model, _reference(samples, routes=False))
    per_lp, per_ent = _per_sample(samples, want_lp), _per_sample(samples, want_ent)

    fields = _verl(samples, routes=False)
    out = policy.compute_logprobs(from_verl(fields), return_entropy=True)
    got, got_ent = logprobs_to_verl(out, fields), entropy_to_verl(out, fields)
    for i, ((_, lp), (_, ent)) in enumerate(zip(per_lp, per_ent, strict=True)):
        r = lp.numel()
        assert _close(got[i, :r], lp) and not got[i, r:].any()
        assert _close(got_ent[i, :r], ent) and not got_ent[i, r:].any()

    data = _nemo(samples, routes=False)
    got = logprobs_to_nemo_rl(policy.compute_logprobs(from_nemo_rl(data)), data)
    for i, (lp_p, lp_r) in enumerate(per_lp):
        n = lp_p.numel() + lp_r.numel()
        assert got[i, 0] == 0 and not got[i, n:].any()
        assert _close(got[i, :n], torch.cat([lp_p, lp_r]))

    output = _trl(samples)
    got = logprobs_to_trl(policy.compute_logprobs(from_trl(output, dtype=torch.float64)), output)
    for i, (_, lp) in enumerate(per_lp):
        assert _close(torch.tensor(got[i], dtype=torch.float64), lp)
