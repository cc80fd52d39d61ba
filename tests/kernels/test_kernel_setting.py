"""execution.kernels and the per-op settings: resolved once (longctx_moe.execution), refused at
start-up where the device cannot run them, and a whole model under "triton" equal to the same
model under "torch".

Tolerance of the model test (fp32): each kernel agrees with its torch path to ~1e-6 relative
(its own tests), and a two-layer forward/backward compounds a few of those: 2e-5 relative on the
loss and every parameter gradient; the routes must be identical."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from longctx_moe.build import resolve_ops
from longctx_moe.config import ConfigError, load_config
from longctx_moe.execution import ExecutionConfig, Target, resolve
from longctx_moe.model import build_model
from longctx_moe.model.moe import LocalDispatcher
from longctx_moe.model.transformer import LogProbHead
from longctx_moe.parallel.parallelize import parallelize
from tests.model.helpers import packed_batch, tiny_config, tiny_ops

pytestmark = pytest.mark.triton
CPU32 = Target("cpu", torch.float32, torch.float32)


def test_triton_on_cpu_outside_the_interpreter_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = load_config(None, ["execution.kernels=triton"])
    with pytest.raises(ConfigError) as e:
        resolve_ops(cfg, torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and "TRITON_INTERPRET=1" in msg and "execution.kernels=auto or torch" in msg
    with pytest.raises(ValueError, match="execution.norm=triton: .*use execution.norm=auto or torch"):
        resolve(ExecutionConfig(norm="triton"), CPU32)  # an op's own setting is named as such


def test_triton_without_the_package_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(ValueError, match=r"triton package is not installed .*longctx-moe\[triton\]"):
        resolve(ExecutionConfig(kernels="triton"), Target("cuda", torch.bfloat16))
    ops = resolve(ExecutionConfig(), Target("cuda", torch.bfloat16))  # auto falls back instead
    assert (ops.norm, ops.router, ops.permute, ops.logprobs) == ("torch",) * 4
    assert "triton package is not installed" in dict(ops.reasons)["router"]


def test_bad_value_and_an_old_model_key_are_refused_by_the_config_loader():
    with pytest.raises(ConfigError, match="execution.kernels='trition'.*did you mean 'triton'"):
        load_config(None, ["execution.kernels=trition"])
    with pytest.raises(ConfigError, match=r"^model.kernels is a choice of how the model runs.*execution.kernels$"):
        load_config(None, ["model.kernels=torch"])


def changed_ops(a, b) -> set[str]:
    """The choices two resolved Ops differ in (their reasons aside)."""
    return {f.name for f in dataclasses.fields(a) if f.name != "reasons" and getattr(a, f.name) != getattr(b, f.name)}


def test_one_setting_changes_one_op():
    base = resolve(ExecutionConfig(kernels="torch"), CPU32)
    norm = resolve(ExecutionConfig(kernels="torch", router="triton"), CPU32)
    assert changed_ops(base, norm) == {"router"} and norm.router == "triton"


def test_auto_on_cpu_and_under_compile():
    ops = resolve(ExecutionConfig(), CPU32)
    assert (ops.router, ops.permute) == ("torch", "torch")  # no Triton on CPU outside kernels=triton
    assert ops.attention.backend == "torch_cpu"
    compiled = resolve(ExecutionConfig(kernels="auto"), dataclasses.replace(CPU32, compile=True))
    assert compiled.norm == "torch" and "train.compile" in dict(compiled.reasons)["norm"]
    f64 = resolve(ExecutionConfig(), Target("cpu", torch.float64, torch.float64))
    assert (f64.norm, f64.swiglu, f64.logprobs, f64.attention.native_forward) == ("torch", "torch", "torch", False)


def test_every_choice_is_printed_with_its_reason():
    lines = resolve(ExecutionConfig(), CPU32).lines()
    assert all(line.startswith("ops: ") for line in lines)
    named = {line.split()[1] for line in lines}
    assert {"attention_backend", "attention_kernels", "norm", "swiglu", "logprobs", "router", "permute",
            "grouped_gemm", "expert_precision", "fp8", "batch_invariant", "recompute"} <= named
    assert all("(" in line for line in lines if line.split()[1] in ("norm", "router", "grouped_gemm"))


def test_parallelize_on_one_rank_keeps_the_triton_permute():
    """The trainer's one-rank runtime installs a LocalDispatcher: it must keep the model's permute."""
    model = build_model(tiny_config(), tiny_ops(kernels="triton"))
    parallelize(model)
    assert all(isinstance(m.dispatcher, LocalDispatcher) and m.dispatcher.impl == "triton"
               for m in model.moe_layers())


def _model_run(kernel_setting, batch, head):
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=300, expert_bias=True, shared_expert_hidden_size=8, first_k_dense=0)
    model = build_model(cfg, tiny_ops(kernels=kernel_setting))
    for layer in model.moe_layers():  # a bias that changes some selections
        layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, cfg.num_experts))
    out = model(batch, head=head)
    loss = out.ce_sum + out.aux_loss + out.z_loss
    if out.entropy_T is not None:
        loss = loss + 0.1 * out.entropy_T.sum()
    loss.backward()
    return out, loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("head", [None, LogProbHead(temperature=0.8, entropy=True)])
def test_model_under_triton_equals_torch_path(head):
    batch = packed_batch([9, 1, 14, 6], vocab=300, pad_multiple=4, trailing_pad=3,
                         generator=torch.Generator().manual_seed(1))
    got, ref = _model_run("triton", batch, head), _model_run("torch", batch, head)
    assert torch.equal(got[0].routes_TLK, ref[0].routes_TLK)
    assert torch.equal(got[0].expert_counts, ref[0].expert_counts)
    torch.testing.assert_close(got[1], ref[1], rtol=2e-5, atol=0)
    assert got[2].keys() == ref[2].keys()
    for name, g in got[2].items():
        scale = ref[2][name].abs().max().item()
        err = (g - ref[2][name]).abs().max().item()
        assert err <= 2e-5 * scale, f"{name}: {err:.3g} vs scale {scale:.3g}"
