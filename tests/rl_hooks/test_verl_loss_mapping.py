"""loss_config_from_verl: each verl actor loss setting mapped to our PolicyLossConfig gives verl's
own ppo_loss (verl 0.9.1) on the same numbers, loss and gradient, in float64."""

from __future__ import annotations

import pytest
import torch

from rl_hooks.adapters import AdapterError, from_verl
from rl_hooks.adapters.verl import loss_config_from_verl, ours_to_nested
from rl_hooks.losses import LossInputs, Normalizers, make_loss
from tests.rl_hooks import verl_cases as vc

pytest.importorskip("verl")

# Same float64 arithmetic in a different order (sums per sequence, masks by where): ~1e-16.
TOL = 1e-12
CASES = {
    "defaults": {},
    "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"loss_agg_mode": "seq-mean-token-sum"},
    "clip-low-high-c": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.4, "clip_ratio_c": 1.5},
    "low_var_kl-clamped": {"use_kl_loss": True, "kl_loss_coef": 0.3, "kl_loss_type": "low_var_kl"},
    "k1": {"use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "k1"},
    "mse": {"use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "mse"},
    "entropy": {"entropy_coeff": 0.05},
}


def _inputs(seed=0):
    """verl's batch with a reference policy far enough off that low_var_kl's +-10 clamp and the
    clip ranges (both sides, and the dual clip) are all active on some tokens."""
    data = vc.padded_batch(seed)
    # float64 fields: with float32 ones verl keeps some intermediates in float32 (~1e-9 here)
    for key in ("old_log_probs", "advantages"):
        data[key] = data[key].double()
    batch = from_verl(data)
    gen = torch.Generator().manual_seed(seed)
    first = batch.cu_seqlens[:-1].long()
    logp = (torch.randn(batch.num_tokens, generator=gen, dtype=torch.float64) * 0.6 - 4.0)
    logp = logp.index_fill(0, first, 0).requires_grad_()
    ent = torch.rand(batch.num_tokens, generator=gen, dtype=torch.float64).index_fill(0, first, 0)
    ref = data["old_log_probs"].double() + torch.randn(data["old_log_probs"].shape, generator=gen,
                                                       dtype=torch.float64) * 6
    data["ref_log_prob"] = ref * data["response_mask"]
    return data, from_verl(data), logp, ent


def _verl_loss(actor, data, logp, ent):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    td = data.clone()
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(td["loss_mask"].sum()),
                         global_batch_size=td.batch_size[0])
    cu = td["input_ids"].offsets()
    out = {"log_probs": ours_to_nested(logp, cu), "entropy": ours_to_nested(ent, cu)}
    return ppo_loss(actor, out, td)[0]


def _our_loss(cfg, batch, logp, ent):
    idx = batch.target_index()
    seq = batch.seq_of_token()[idx]
    _, seq_index = torch.unique_consecutive(seq, return_inverse=True)
    inp = LossInputs(logprobs=logp[idx], old_logprobs=batch.old_logprobs[idx], advantages=batch.advantages[idx],
                     seq_index=seq_index, num_seqs_local=int(seq.unique().numel()),
                     ref_logprobs=batch.ref_logprobs[idx], entropy=ent[idx])
    norm = Normalizers(num_tokens=idx.numel(), num_seqs=int(seq.unique().numel()))
    return make_loss(cfg)(inp, norm).loss


@pytest.mark.parametrize("over", CASES.values(), ids=CASES.keys())
def test_each_verl_loss_setting_gives_verls_loss_and_gradient(over):
    actor = vc.actor_config(**over)
    data, batch, logp, ent = _inputs()
    cfg, steps = loss_config_from_verl(actor, batch.num_seqs)
    assert steps == {"mini_batches": 1, "epochs": 1}
    want = _verl_loss(actor, data, logp, ent)
    (g_want,) = torch.autograd.grad(want, logp)
    got = _our_loss(cfg, batch, logp, ent)
    (g_got,) = torch.autograd.grad(got, logp)
    got, want = got.item(), want.item()
    assert abs(got - want) <= TOL, (got, want)
    assert float((g_got - g_want).abs().max()) <= TOL
    assert g_want.abs().max() > 0


def test_epochs_and_mini_batches_and_refusals():
    cfg, steps = loss_config_from_verl(vc.actor_config(ppo_mini_batch_size=2, ppo_epochs=3), 8)
    assert steps == {"mini_batches": 4, "epochs": 3}
    for over, key in [({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_agg_mode"),
                      ({"use_kl_loss": True, "kl_loss_type": "full"}, "kl_loss_type"),
                      ({"ppo_mini_batch_size": 3}, "ppo_mini_batch_size")]:
        with pytest.raises(AdapterError, match=f"^verl field '{key}'") as err:
            loss_config_from_verl(vc.actor_config(**over), 8)
        assert "\n" not in str(err.value)
