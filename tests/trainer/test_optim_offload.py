"""optim.offload=cpu (optim_offload.HostAdamW) against the device optimizer (optim.offload=none).

On this CPU the "device" is the host too, but the path is the one a GPU runs: the masters,
moments and gradient buffers are separate host tensors, gradients are copied in before the step
and the updated masters copied back into the parameters (a run that forgot either diverges at the
first update). Both copies are exact, so with the same AdamW implementation on both sides the
runs are bitwise equal: losses, parameters, masters. With different implementations (fused on
the host copies, foreach on the device, as the distributed optimizer's strided slabs take with
optim.impl=auto; a GPU's device optimizer runs CUDA's fused kernel) each update differs by an ulp
here and there (the kernels order AdamW's operations differently). Computing in fp32, 20 steps of
this model keep the losses within 6e-8 relative (an ulp of the loss is 1.1e-7 of it): TOL = 1e-6.
Under bf16 autocast the same ulps grow to ~1e-4 of the loss by step 20 (measured 1.1e-4, and
the same between fused and foreach on the device alone): a master an ulp apart can round to
another bf16 weight, 2^-8 apart, in the forward. So that comparison runs in fp32.

Grad clipping is active (optim.grad_clip=0.1, below every step's norm) and the LR schedule
varies each step (warmup then cosine), so both feed each compared update.
"""

from __future__ import annotations

import pytest
import torch

from longctx_moe.build import model_of
from longctx_moe.checkpoint.resume import maybe_resume
from longctx_moe.checkpoint.sharded_state import trainer_pieces
from longctx_moe.checkpoint.trainer_state import save
from longctx_moe.config import ConfigError, load_config
from longctx_moe.optim_offload import HostAdamW
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.precision import cast_params
from longctx_moe.process import RunContext
from longctx_moe.trainer import Trainer, iterate_steps
from tests.launcher import run_distributed
from tests.trainer.toy import ToyStepLoader

STEPS = 20
TOL = 1e-6
SMALL = ["model.vocab_size=66", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.head_dim=16", "model.num_experts=4", "model.expert_hidden_size=16",
         "model.expert_bias=true", "optim.warmup_steps=2", "optim.grad_clip=0.1", "train.autocast_dtype=bf16"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _trainer(offload: str, dtype: str = "fp32", sets: tuple = (), rank: int = 0, world: int = 1) -> Trainer:
    cfg = load_config(None, [*SMALL, *sets, f"optim.offload={offload}", f"train.param_dtype={dtype}"])
    dims = None
    if world > 1:
        dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
        dims.build_groups(rank)
    torch.manual_seed(0)
    model = cast_params(model_of(cfg), DTYPES[dtype])
    return Trainer(cfg, parallelize(model, dims, cfg.parallel) if dims else parallelize(model))


def _losses(trainer: Trainer, steps: int, loader=None) -> list[float]:
    loader = loader or ToyStepLoader(vocab=66, rank=trainer.dims.rank_in("dp"))  # each replica its own data
    return [trainer.train_step(b).loss for b in iterate_steps(loader, trainer.step, steps)]


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _host(trainer: Trainer) -> HostAdamW:
    opt = trainer.optimizer
    return opt if isinstance(opt, HostAdamW) else opt.optimizer  # the distributed optimizer's inner one


def _compare(dtype: str, sets: tuple, rank: int = 0, world: int = 1) -> tuple[list, list, int]:
    """(device losses, offloaded losses, parameters that differ) after STEPS steps each."""
    device, host = _trainer("none", dtype, sets, rank, world), _trainer("cpu", dtype, sets, rank, world)
    ref, got = _losses(device, STEPS), _losses(host, STEPS)
    a, b = _params(device), _params(host)
    differ = sum(not torch.equal(a[n], b[n]) for n in a)
    opt = _host(host)
    assert isinstance(opt, HostAdamW)
    for t, m in zip(opt.tensors, opt.masters, strict=True):
        assert m.device.type == "cpu" and m.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert m.dtype == torch.float32 and torch.equal(t, m.to(t.dtype))  # the weights are the masters
    return ref, got, differ


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_one_rank_trains_bitwise_as_the_device_optimizer(dtype):
    ref, got, differ = _compare(dtype, ())
    assert got == ref and differ == 0
    assert len(set(ref)) == STEPS  # every step moved the weights


def test_fused_on_the_host_against_foreach_on_the_device_within_tol():
    device = _trainer("none", sets=("optim.impl=foreach", "train.autocast_dtype=none"))
    host = _trainer("cpu", sets=("optim.impl=fused", "train.autocast_dtype=none"))
    ref, got = _losses(device, STEPS), _losses(host, STEPS)
    assert max(abs(a - b) / a for a, b in zip(ref, got, strict=True)) < TOL
    assert got != ref  # the kernels do round differently: the tolerance measures something


def _four_ranks(rank, world):
    # dense parameters over dp_cp = 4, experts over edp = 2; 66 vocabulary rows do not split 4
    # ways: the embedding's slabs are strided columns, copied to contiguous host masters
    sets = ("parallel.ep=2", "parallel.distributed_optimizer=true", "optim.impl=foreach")
    return {dtype: _compare(dtype, sets, rank, world) for dtype in DTYPES}


@pytest.mark.slow
def test_four_gloo_ranks_with_the_distributed_optimizer_train_bitwise_as_the_device_optimizer():
    for by_dtype in run_distributed(_four_ranks, world_size=4, timeout=900):
        for dtype, (ref, got, differ) in by_dtype.items():
            assert got == ref and differ == 0 and len(set(ref)) == STEPS, dtype


def _run(tmp, offload: str, dtype: str, steps: int = 6):
    trainer = _trainer(offload, dtype, (f"train.steps={steps}",))
    return trainer, ToyStepLoader(vocab=66), RunContext(0, 1, 1, torch.device("cpu"), tmp, tmp / "ckpt")


def _keys(trainer: Trainer) -> dict[str, tuple]:
    return {k: (tuple(p.tensor.shape), p.tensor.dtype) for k, p in trainer_pieces(trainer.model, trainer.optimizer).items()}


@pytest.mark.parametrize("saved, resumed", [("cpu", "none"), ("none", "cpu")])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_checkpoint_resumes_across_the_setting_bitwise(tmp_path, saved, resumed, dtype):
    ref, ref_loader, _ = _run(tmp_path / "ref", resumed, dtype)
    _losses(ref, 6, ref_loader)
    first, loader, ctx = _run(tmp_path / "run", saved, dtype)
    _losses(first, 3, loader)
    assert _keys(first) == _keys(_trainer_after_one_step(resumed, dtype))  # the same keys either way
    save(first, loader, ctx)
    second, loader2, ctx2 = _run(tmp_path / "run", resumed, dtype)
    assert maybe_resume(second, loader2, ctx2) is not None and second.step == 3
    _losses(second, 6, loader2)
    a, b = _params(ref), _params(second)
    assert all(torch.equal(a[n], b[n]) for n in a)
    sa, sb = ref.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def _trainer_after_one_step(offload: str, dtype: str) -> Trainer:
    trainer = _trainer(offload, dtype)
    _losses(trainer, 1)
    return trainer


def test_the_setting_is_checked(monkeypatch):
    with pytest.raises(ConfigError, match="optim.offload"):
        load_config(None, ["optim.offload=gpu"])
    import longctx_moe.optim_offload as optim_offload

    monkeypatch.setattr(optim_offload, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    with pytest.raises(ConfigError, match=r"optim.offload=cpu with optim.impl=fused needs .*set optim.impl=auto"):
        _trainer("cpu", sets=("optim.impl=fused",))


def test_rl_offload_has_no_optimizer_on_the_device_and_says_so(capsys):
    from rl_hooks import PolicyLossConfig, PolicyTrainer, make_loss
    from tests.rl_hooks.helpers import config, rollout_batch

    loss = make_loss(PolicyLossConfig(kind="ppo"))
    plain, moved = (PolicyTrainer(config("optim.offload=cpu", "optim.weight_decay=0.1")) for _ in range(2))
    moved.export_gate.residency.moves = True  # copy and free as on a GPU (tests/rl_hooks/test_offload.py)
    for policy in (plain, moved):
        policy.train_step(rollout_batch(0), loss)
    sent = moved.offload()
    assert sent["optimizer"] == 0 and sent["params"] > 0
    assert moved.export_gate.residency.device_bytes() == 0  # the host masters are no device bytes
    moved.onload()
    for policy in (plain, moved):
        policy.train_step(rollout_batch(1), loss)
    assert all(torch.equal(a, b) for a, b in zip(plain.runtime.model.parameters(), moved.runtime.model.parameters(),
                                                  strict=True))
    said = [line for line in capsys.readouterr().out.splitlines() if "optim.offload=cpu" in line]
    assert said == ["offload: optim.offload=cpu keeps the optimizer's state in host memory; its part has "
                    "nothing on the device to move"]


def _pending_gradients_round_trip(rank, world):
    from rl_hooks import PolicyLossConfig, PolicyTrainer, make_loss
    from tests.rl_hooks.helpers import config, rollout_batch

    loss = make_loss(PolicyLossConfig(kind="ppo"))
    sets = ("optim.offload=cpu", "parallel.distributed_optimizer=true")
    plain, moved = (PolicyTrainer(config(*sets)) for _ in range(2))
    moved.export_gate.residency.moves = True
    for policy in (plain, moved):
        policy.forward_backward(rollout_batch(2), loss)
    sent = moved.offload()
    # the slabs' reduced gradients wait on the device for the host step: they move too
    gone = moved.export_gate.residency.device_bytes() == 0
    moved.onload()
    for policy in (plain, moved):
        policy.optimizer_step()
    same = all(torch.equal(a, b) for a, b in zip(plain.runtime.model.parameters(), moved.runtime.model.parameters(),
                                                  strict=True))
    return sent["grads"], gone, same


@pytest.mark.slow
def test_rl_offload_between_backward_and_step_moves_the_slabs_gradients():
    for grads, gone, same in run_distributed(_pending_gradients_round_trip, world_size=2, timeout=600):
        assert grads > 0 and gone and same
