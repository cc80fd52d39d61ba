"""The NeMo-RL policy worker on a Qwen3-MoE made and saved by transformers, float64, with the
batches NeMo-RL's GRPO loop hands a worker (right-padded [B, S] BatchedDataDict fields):

- get_logprobs equals transformers' forward on each row (to 1e-6: transformers computes RMSNorm
  and softmaxes in float32 even for a float64 model, ~1e-7 relative);
- train's first global-batch loss equals NeMo-RL's ClippedPG formula on the worker's log-probs
  (1e-10: float64, only the order of sums differs), and its
  return has the fields NeMo-RL's Policy and GRPO loop read;
- reference log-probs stay those of the start-up weights after an update;
- the weight stream and prepare_refit_info agree, and carry the HF model's own tensors;
- two data-parallel ranks, each given its contiguous shard, equal one process;
- every setting the worker cannot honour is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch

from longctx_moe.config import ConfigError
from rl_hooks.plugins.nemo_rl import LongctxMoePolicyWorker
from rl_hooks.plugins.nemo_rl.loss import DEFAULTS
from tests.launcher import run_distributed
from tests.rl_hooks.test_nemo_rl_loss_mapping import nemo_clipped_pg
from tests.rl_hooks.verl_cases import ROOT, VOCAB, hf_model, our_sets, save_hf_model

TOL = 1e-10
HF_TOL = 1e-6  # transformers' float32 RMSNorm / softmax inside its float64 forward
LENGTHS = [(3, 5), (6, 2), (2, 7), (4, 4)]  # (prompt, response) per row
LOSS = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "reference_policy_kl_penalty": 0.05}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("nemo_hf"), "float64")


def policy_config(hf_dir, **changes):
    cfg = {"model_name": str(hf_dir), "precision": "float64", "train_global_batch_size": 4,
           "max_grad_norm": 0.0,
           "optimizer": {"name": "torch.optim.AdamW",
                         "kwargs": {"lr": 1e-2, "weight_decay": 0.0, "betas": [0.9, 0.999],
                                    "eps": 1e-8, "foreach": False}},
           "dynamic_batching": {"enabled": True, "train_mb_tokens": 16, "logprob_mb_tokens": 16},
           "generation": {"temperature": 1.0, "top_k": None, "top_p": 1.0},
           "dtensor_cfg": {"enabled": True, "tensor_parallel_size": 1, "context_parallel_size": 1},
           "longctx_moe": {"config": str(ROOT / "configs/tiny_cpu.yaml"),
                           "overrides": our_sets("float64") + ["optim.warmup_steps=0",
                                                               "optim.schedule=constant"]}}
    cfg.update(changes)
    return cfg


def nemo_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A GRPO train batch as NeMo-RL lays it out: tokens right-padded, the response tokens in
    token_mask, per-token fields aligned with input_ids (position 0 unused)."""
    g = torch.Generator().manual_seed(seed)
    width = max(p + r for p, r in LENGTHS) + 1
    b = len(LENGTHS)
    ids = torch.zeros(b, width, dtype=torch.long)
    tmask = torch.zeros(b, width)
    for i, (p, r) in enumerate(LENGTHS):
        ids[i, :p + r] = torch.randint(0, VOCAB, (p + r,), generator=g)
        tmask[i, p:p + r] = 1.0
    f64 = dict(dtype=torch.float64)
    return {"input_ids": ids, "input_lengths": torch.tensor([p + r for p, r in LENGTHS]),
            "token_mask": tmask, "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
            "advantages": torch.randn(b, 1, generator=g, **f64).expand(b, width) * tmask}


def hf_logprobs(hf_dir, data) -> torch.Tensor:
    """transformers' forward on each row alone: log p(ids[t] | < t) at t, 0 at t = 0."""
    model = hf_model(hf_dir, "float64")
    out = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    for i, n in enumerate(data["input_lengths"].tolist()):
        ids = data["input_ids"][i, :n]
        with torch.no_grad():
            logp = model(ids[None]).logits[0].log_softmax(-1)
        out[i, 1:n] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
    return out


def with_logprob_fields(data, logp, seed=1):
    g = torch.Generator().manual_seed(seed)
    noise = lambda s: s * torch.randn(logp.shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {**data, "prev_logprobs": logp + noise(0.05), "generation_logprobs": logp + noise(0.1),
            "reference_policy_logprobs": logp + noise(0.3)}


def test_logprobs_equal_transformers_and_train_computes_nemo_rls_loss(hf_dir):
    worker = LongctxMoePolicyWorker(policy_config(hf_dir))
    data = nemo_batch()
    got = worker.get_logprobs(data)["logprobs"]
    want = hf_logprobs(hf_dir, data)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert float((got - want).abs().max()) <= HF_TOL

    full = with_logprob_fields(data, got)
    res = worker.train(full, dict(LOSS))
    sl = {k: (v[:, 1:] if torch.is_tensor(v) and v.ndim == 2 else v) for k, v in full.items()}
    theirs = nemo_clipped_pg({**DEFAULTS, **LOSS}, got[:, 1:], sl["prev_logprobs"],
                             sl["generation_logprobs"], sl["reference_policy_logprobs"],
                             sl["advantages"], sl["token_mask"], full["sample_mask"])
    assert res["global_loss"].shape == (1,)
    assert abs(float(res["global_loss"][0]) - float(theirs)) <= TOL
    assert res["grad_norm"].ndim == 0 and float(res["grad_norm"]) > 0
    m = res["all_mb_metrics"]
    assert m["global_valid_toks"] == [float((full["token_mask"] * full["sample_mask"][:, None])[:, 1:].sum())]
    assert m["num_valid_samples"] == [3.0] and m["loss"] == [float(res["global_loss"][0])]
    for key in ("probs_ratio", "probs_ratio_min", "probs_ratio_max", "kl_penalty",
                "sampling_importance_ratio", "lr", "global_valid_seqs"):
        assert len(m[key]) == 1, key


def test_reference_logprobs_are_the_start_up_weights_after_an_update(hf_dir):
    worker = LongctxMoePolicyWorker(policy_config(hf_dir))
    data = nemo_batch()
    before = worker.get_logprobs(data)["logprobs"]
    worker.train(with_logprob_fields(data, before), dict(LOSS))
    after = worker.get_logprobs(data)["logprobs"]
    ref = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert float((after - before).abs().max()) > 1e-4  # the update moved the policy
    assert torch.equal(ref, before)
    assert torch.equal(worker.get_logprobs(data)["logprobs"], after)  # and the swap is undone


def test_the_weight_stream_matches_its_refit_info_and_the_hf_weights(hf_dir):
    from safetensors.torch import load_file

    worker = LongctxMoePolicyWorker(policy_config(hf_dir), init_reference_model=False)
    info = worker.prepare_refit_info(torch.float64)
    sent = {n: t for bucket in worker.stream_weights(1 << 14, torch.float64) for n, t in bucket}
    assert list(info) == list(sent)
    assert all(info[n] == (t.shape, t.dtype) for n, t in sent.items())
    saved = load_file(hf_dir / "model.safetensors")
    per_expert = {n: t for n, t in sent.items() if n in saved}
    assert len(per_expert) >= len(sent) // 2
    assert all(torch.equal(t, saved[n]) for n, t in per_expert.items())


@pytest.mark.slow  # two gloo ranks
def test_two_dp_ranks_with_their_shards_equal_one_process(hf_dir):
    """A global batch of 4 over DP2 (each rank its 2 contiguous rows, as NeMo-RL's
    shard_by_batch_size hands them) is one step equal to one process given all 4 rows."""
    data = nemo_batch()
    one = LongctxMoePolicyWorker(policy_config(hf_dir), init_reference_model=False)
    logp = one.get_logprobs(data)["logprobs"]
    res = one.train(with_logprob_fields(data, logp), dict(LOSS))
    runs = run_distributed(_dp_rank_sets, world_size=2, args=(str(hf_dir), logp), timeout=300)
    assert float((torch.cat([r[0] for r in runs]) - logp).abs().max()) <= TOL
    for got_loss, params in ((r[1], r[2]) for r in runs):
        assert abs(float(got_loss[0]) - float(res["global_loss"][0])) <= TOL
        for p, q in zip(params, one._params(), strict=True):
            assert float((p - q.detach()).abs().max()) <= TOL


def _dp_rank_sets(rank, world, hf_dir, logp):
    full = with_logprob_fields(nemo_batch(), logp)
    shard = {k: v[rank * 2:rank * 2 + 2] for k, v in full.items()}
    cfg = policy_config(hf_dir)
    cfg["longctx_moe"]["overrides"] = cfg["longctx_moe"]["overrides"] + ["parallel.dp=2"]
    worker = LongctxMoePolicyWorker(cfg, init_reference_model=False)
    got = worker.get_logprobs(shard)["logprobs"]
    res = worker.train(shard, dict(LOSS))
    return got, res["global_loss"], [p.detach().clone() for p in worker._params()]


@pytest.mark.parametrize("change, fragment", [
    (dict(megatron_cfg={"enabled": True}), "policy.megatron_cfg.enabled"),
    (dict(scheduler=[{"name": "torch.optim.lr_scheduler.LinearLR"}]), "policy.scheduler"),
    (dict(generation={"top_k": 20}), "top_k=20"),
    (dict(dynamic_batching={"enabled": False}), "policy.dynamic_batching.enabled"),
    (dict(optimizer={"name": "torch.optim.SGD"}), "policy.optimizer.name"),
    (dict(optimizer={"name": "torch.optim.AdamW", "kwargs": {"amsgrad": True}}),
     "policy.optimizer.kwargs.amsgrad"),
    (dict(dtensor_cfg={"enabled": True, "tensor_parallel_size": 2}),
     "policy.dtensor_cfg.tensor_parallel_size"),
    (dict(precision="float16"), "policy.precision"),
    (dict(longctx_moe={}), "policy.longctx_moe.config"),
])
def test_settings_the_worker_cannot_honour_are_refused_in_one_line(hf_dir, change, fragment):
    with pytest.raises(ConfigError) as e:
        LongctxMoePolicyWorker(policy_config(hf_dir, **change))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_train_refuses_eval_mode_and_a_global_batch_that_does_not_divide(hf_dir):
    worker = LongctxMoePolicyWorker(policy_config(hf_dir), init_reference_model=False)
    data = nemo_batch()
    data = with_logprob_fields(data, torch.zeros(data["input_ids"].shape, dtype=torch.float64))
    with pytest.raises(ConfigError, match="eval_mode"):
        worker.train(data, dict(LOSS), eval_mode=True)
    with pytest.raises(ConfigError, match="train_global_batch_size / dp = 3"):
        worker.train(data, dict(LOSS), gbs=3)
    assert copy.deepcopy(worker.policy_cfg) == policy_config(hf_dir)  # the caller's dict untouched
