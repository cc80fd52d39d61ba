"""Triton balance statistics (sequence-wise aux loss, router z-loss, counts per expert) against
the torch path of MoE.stats (losses.sequence_aux_loss, losses.router_z_loss, losses.id_counts).

Tolerances: the kernel sums each document's loss token by token (c_s * sum_e count_se * p_te)
where torch first sums p over the document, and its exp / log run under numpy: 1e-5 relative on
the losses and 1e-6 absolute on the gradients (values ~1e-3). The counts are integers: equal."""

from __future__ import annotations

import pytest
import torch

from longctx_moe.kernels import LAUNCHES_PER_CALL, triton_ops
from longctx_moe.model.losses import id_counts, router_z_loss, sequence_aux_loss

pytestmark = pytest.mark.triton

AUX, ZC = 0.01, 1e-3


def _inputs(t=45, e=12, k=3, docs=(10, 1, 20, 7), pad=7, sigmoid=False, seed=0):
    """Logits, scores, top-k ids and doc ids of a packed row: documents in order, padding last."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, e, generator=g) * 2).requires_grad_()
    scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(docs)] + [torch.full((pad,), -1)])
    assert doc.numel() == t
    return logits, scores, idx, doc, len(docs)


def _torch_path(logits, scores, idx, doc, num_docs):
    real = doc >= 0
    aux = AUX * sequence_aux_loss(scores, idx, doc, num_docs).sum() / num_docs
    z = ZC * router_z_loss(logits, None, real)
    return aux, z, id_counts(idx, scores.shape[1], real[:, None].expand_as(idx))


def _grads(logits, aux, z, seed=3):
    g = torch.Generator().manual_seed(seed)
    ga, gz = torch.rand((), generator=g) + 0.5, torch.rand((), generator=g) + 0.5
    return torch.autograd.grad(aux * ga + z * gz, logits, retain_graph=True)[0]


@pytest.mark.parametrize("sigmoid", [False, True])
def test_balance_losses_match_torch(sigmoid):
    logits, scores, idx, doc, n = _inputs(sigmoid=sigmoid)
    ref = _torch_path(logits, scores, idx, doc, n)
    got = triton_ops().balance_losses(scores, logits, idx, doc, n, AUX, ZC)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=0)
    assert got[2].dtype == torch.int64 and torch.equal(got[2], ref[2])
    torch.testing.assert_close(_grads(logits, *got[:2]), _grads(logits, *ref[:2]), rtol=0, atol=1e-6)


def test_padding_and_document_order_do_not_matter():
    """Padding between documents and documents out of order give the same losses (the kernel
    sums per token; the torch path's per-document sums need order, so compare to a sorted row)."""
    logits, scores, idx, doc, n = _inputs(docs=(9, 14, 15), pad=7, seed=4)
    perm = torch.randperm(doc.numel(), generator=torch.Generator().manual_seed(5))
    ref = triton_ops().balance_losses(scores, logits, idx, doc, n, AUX, ZC)
    got = triton_ops().balance_losses(scores[perm], logits[perm], idx[perm], doc[perm], n, AUX, ZC)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_z_loss_off_and_a_lone_loss_backward():
    """z_coeff 0: z is 0 with no gradient; the aux loss alone back-propagates as torch's."""
    logits, scores, idx, doc, n = _inputs(seed=6)
    aux, z, _ = triton_ops().balance_losses(scores, logits, idx, doc, n, AUX, 0.0)
    assert z.item() == 0.0
    ref = AUX * sequence_aux_loss(scores, idx, doc, n).sum() / n
    got_g = torch.autograd.grad(aux, logits, retain_graph=True)[0]
    torch.testing.assert_close(got_g, torch.autograd.grad(ref, logits)[0], rtol=0, atol=1e-6)


def test_launches(launches):
    """Four launches forward (the count buffer's fill is torch's), one backward."""
    logits, scores, idx, doc, n = _inputs()
    aux, z, _ = triton_ops().balance_losses(scores, logits, idx, doc, n, AUX, ZC)
    assert len(launches) == 3
    assert LAUNCHES_PER_CALL["longctx.balance_fwd"] == len(launches) + 1  # what the step's counts take
    launches.clear()
    (aux + z).backward()
    assert len(launches) == 1


def test_refuses_no_document():
    logits, scores, idx, doc, _ = _inputs()
    with pytest.raises(ValueError, match="num_docs=0"):
        triton_ops().balance_losses(scores, logits, idx, doc, 0, AUX, ZC)


def _moe_stats(router: str, reduce=None):
    """MoE.stats of one routed micro-batch (packed documents and padding) on the router's path."""
    from types import SimpleNamespace

    from longctx_moe.execution import Ops
    from longctx_moe.model.config import ModelConfig
    from longctx_moe.model.moe import MoE

    torch.manual_seed(0)
    moe = MoE(ModelConfig(hidden_size=16, num_experts=12, top_k=3, expert_hidden_size=8), Ops(router=router))
    torch.nn.init.normal_(moe.router.weight, std=0.5, generator=torch.Generator().manual_seed(2))
    x = torch.randn(45, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    _, _, _, doc, n = _inputs()
    layout = SimpleNamespace(reduce_stats=reduce, real_mask_T=doc >= 0, balance_losses=True, doc_id_T=doc,
                             num_docs=n)
    idx, _, aux = moe.router(x)
    stats = moe.stats(idx, aux, layout)
    g = torch.autograd.grad(stats.aux_loss + stats.z_loss, (x, moe.router.weight))
    return stats, g


def test_moe_stats_take_the_kernels_with_the_triton_router(launches):
    ref, g_ref = _moe_stats("torch")
    launches.clear()
    got, g_got = _moe_stats("triton")
    assert any(k.fn.__name__ == "_counts_kernel" for k in launches), "the Triton router's MoE takes the kernels"
    torch.testing.assert_close(got.aux_loss, ref.aux_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.z_loss, ref.z_loss, rtol=1e-5, atol=0)
    assert torch.equal(got.counts_E, ref.counts_E)
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_moe_stats_keep_torch_under_a_reduction(launches):
    """A reduction over ranks (CP, the global-batch loss) sums the torch path's statistics."""
    _moe_stats("triton", reduce=lambda t: t)
    assert launches and not any(k.fn.__name__ == "_counts_kernel" for k in launches)
