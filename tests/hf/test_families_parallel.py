"""Every family from a Hugging Face directory under TP2 x CP2 x EP2 on 8 gloo ranks against one
process, float64 (OLMoE's q/k norm over all heads sums its squares over TP): each rank reads
only its slices (PolicyTrainer.from_pretrained), and log-probs and one optimizer step's parameter
updates (which reveal the gradients: tests/rl_hooks/helpers.py) equal the single-process ones.
Tolerance 1e-10: float64, only the summation order differs (sums over ranks)."""

from __future__ import annotations

import pytest

from longctx_moe.parallel.sharding import global_slice
from rl_hooks import PolicyLossConfig, PolicyTrainer, make_loss
from tests.hf.families_cases import CASES, save_random
from tests.launcher import run_distributed
from tests.rl_hooks.helpers import EPS, params, rollout_batch, updates

TOL = 1e-10
SETS = ["train.param_dtype=fp64", "train.autocast_dtype=none", "train.num_threads=1",
        "train.host_allocator=default", "execution.loss_chunk_tokens=5", "balance.aux_loss_coeff=0",
        "balance.z_loss_coeff=0", f"optim.eps={EPS}",
        "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.schedule=constant"]
LAYOUT = ["parallel.tp=2", "parallel.cp=2", "parallel.ep=2"]
# gpt-oss's sliding windows run under the ring like every family (test_attention_families_parallel
# covers them under Ulysses); its expert biases and output / router biases are also checked under
# ETP2 (the EP2 ranks' hidden units split) and sequence parallelism.
# The families whose routers have the aux-loss-free bias keep it fixed.
FAMILY_LAYOUT = {"gpt_oss": ["parallel.etp=2", "parallel.sequence_parallel=true"],
                 "glm4_moe": ["balance.expert_bias_update_rate=0"],
                 "deepseek_v3": ["balance.expert_bias_update_rate=0"]}


def _run(hf_dir: str, sets: list[str]):
    policy = PolicyTrainer.from_pretrained(hf_dir, SETS + sets, micro_batch_tokens=24)
    batch = rollout_batch()
    out = policy.compute_logprobs(batch)
    before = params(policy)
    policy.train_step(batch, make_loss(PolicyLossConfig(kind="ppo")), lr=EPS)
    # where each rank's piece sits in the whole tensor: the splits the parallelizers declared
    where = {name: global_slice(p)[1] for name, p in policy.runtime.model.named_parameters()}
    return out.logprobs, updates(policy, before), where


def _rank(rank, world, dirs):
    return {family: _run(path, LAYOUT + FAMILY_LAYOUT.get(family, [])) for family, path in dirs.items()}


def _slice(name, got, want, where):
    """This rank's piece of the single-process tensor `want` for a parameter shaped like `got`."""
    for dim, (n, offset) in enumerate(zip(got.shape, where[name], strict=True)):
        want = want.narrow(dim, offset, n)
    return want


@pytest.mark.slow
def test_families_match_one_process_under_tp2_cp2_ep2_float64(tmp_path):
    dirs = {}
    for family, cases in CASES.items():
        dirs[family] = str(tmp_path / family)
        save_random(family, cases[0], dirs[family])
    refs = {family: _run(path, []) for family, path in dirs.items()}
    results = run_distributed(_rank, world_size=8, args=(dirs,), timeout=900)
    for got in results:
        for family, (logp, steps, where) in got.items():
            ref_logp, ref_steps, _ = refs[family]
            assert (logp - ref_logp).abs().max() < TOL, family
            assert any(v.abs().max() > 0 for v in ref_steps.values())
            for name, g in steps.items():
                assert (g - _slice(name, g, ref_steps[name], where)).abs().max() < TOL, (family, name)
