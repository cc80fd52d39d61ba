"""model.kernels: refused at start-up where Triton cannot run, resolved per call, and a whole
model under "triton" equal to the same model under "torch".

Tolerance of the model test (fp32): each kernel agrees with its torch path to ~1e-6 relative
(its own tests), and a two-layer forward/backward compounds a few of those: 2e-5 relative on the
loss and every parameter gradient; the routes must be identical."""

from __future__ import annotations

import pytest
import torch

import longctx_moe.kernels as kernels
from longctx_moe.build import check_backends
from longctx_moe.config import ConfigError, load_config
from longctx_moe.kernels import check_kernels, use_triton
from longctx_moe.model import build_model
from longctx_moe.model.moe import LocalDispatcher
from longctx_moe.model.transformer import LogProbHead
from longctx_moe.parallel.parallelize import parallelize
from tests.model.helpers import packed_batch, tiny_config

pytestmark = pytest.mark.triton


def test_triton_on_cpu_outside_the_interpreter_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = load_config(None, ["model.kernels=triton"])
    with pytest.raises(ConfigError) as e:
        check_backends(cfg, torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and "TRITON_INTERPRET=1" in msg and "model.kernels=auto or torch" in msg
    with pytest.raises(ValueError, match="model.kernels='triton'"):  # and at the call, too
        use_triton("triton", torch.zeros(1))


def test_triton_without_the_package_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "_installed", lambda: False)
    with pytest.raises(ValueError, match=r"triton package is not installed .*longctx-moe\[triton\]"):
        check_kernels("triton", "cuda")
    assert not use_triton("auto", torch.zeros(1))  # auto falls back instead


def test_bad_value_is_refused_by_the_config_loader():
    with pytest.raises(ConfigError, match="model.kernels='trition'.*did you mean 'triton'"):
        load_config(None, ["model.kernels=trition"])


def test_auto_is_torch_on_cpu_and_triton_runs_under_the_interpreter(monkeypatch):
    check_backends(load_config(None, ["model.kernels=triton"]), torch.device("cpu"))  # allowed
    assert not use_triton("auto", torch.zeros(1)) and not use_triton("torch", torch.zeros(1))
    assert use_triton("triton", torch.zeros(1))
    # What torch.compile traces is left to inductor's own fused kernels.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not use_triton("triton", torch.zeros(1))


def test_parallelize_on_one_rank_keeps_the_triton_permute():
    """The trainer's one-rank runtime installs a LocalDispatcher: it must keep model.kernels."""
    model = build_model(tiny_config(kernels="triton"))
    parallelize(model)
    assert all(isinstance(m.dispatcher, LocalDispatcher) and m.dispatcher.kernels == "triton"
               for m in model.moe_layers())


def _model_run(kernel_setting, batch, head):
    torch.manual_seed(0)
    cfg = tiny_config(kernels=kernel_setting, vocab_size=300, expert_bias=True,
                      shared_expert_hidden_size=8, first_k_dense=0)
    model = build_model(cfg)
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
