"""The Triton kernels as torch operators: every entry point of triton_ops() runs forward and
backward on `meta` tensors (no storage: the cluster rehearsal's stand-in for the GPU) with no
kernel launch, and gives the shapes and dtypes of the interpreter's run on the same CPU inputs;
torch.library.opcheck checks each operator's schema, fake implementation (against the real
outputs), autograd registration and tracing."""

from __future__ import annotations

import pytest
import torch

from longctx_moe.kernels import triton_ops
from longctx_moe.model.moe import permute_layout

pytestmark = pytest.mark.triton

OPS = ("rmsnorm_fwd", "add_rmsnorm_fwd", "rmsnorm_bwd", "add_rmsnorm_bwd", "permute_fwd", "permute_bwd",
       "unpermute_fwd", "unpermute_bwd", "router_topk_fwd", "router_topk_bwd", "balance_fwd", "balance_bwd",
       "route_layout", "logprobs_stats", "logprobs_grad", "swiglu_fwd", "swiglu_bwd", "rope_fwd", "rope_bwd")


def _randn(*shape, dtype=torch.float32, seed=0, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


def _slots(t=19, k=2, e=4, pad=True):
    g = torch.Generator().manual_seed(1)
    idx_TK = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    slot_TK, _, total = permute_layout(idx_TK, e, pad)
    return slot_TK, total


def _rmsnorm():
    return "rmsnorm", (_randn(5, 3, 32), _randn(32, seed=1), 1e-6, torch.bfloat16)


def _add_rmsnorm():
    return "add_rmsnorm", (_randn(41, 96), _randn(41, 96, dtype=torch.bfloat16, seed=1),
                           _randn(96, seed=2), 1e-6, torch.bfloat16)


def _swiglu():
    h = _randn(9, 2 * 40)
    return "swiglu", tuple(h.detach().chunk(2, dim=-1)[i].requires_grad_() for i in (0, 1))


def _rope(interleaved):
    """q a strided view of a wider tensor, one k head, bf16 tables; partial rotary (R=6 of 10)."""
    tables = (_randn(7, 6, dtype=torch.bfloat16, seed=2, grad=False) for _ in range(2))
    return lambda: ("rope", (_randn(7, 3, 13, dtype=torch.bfloat16)[..., 3:],
                             _randn(7, 1, 10, dtype=torch.bfloat16, seed=1), *tables, interleaved))


def _permute():
    slot_TK, total = _slots()
    return "permute", (_randn(19, 64), slot_TK, total, torch.bfloat16)


def _unpermute():
    slot_TK, total = _slots()
    w_TK = torch.rand(19, 2).to(torch.bfloat16).requires_grad_()
    return "unpermute", (_randn(total, 64, dtype=torch.bfloat16), slot_TK, w_TK)


def _router(score):
    return lambda: ("router_topk", (_randn(37, 12), score, 3, True, torch.linspace(-0.2, 0.2, 12)))


def _balance():
    """Scores and logits of 23 tokens over 12 experts, 3 documents and padding."""
    z = _randn(23, 12)
    idx = torch.stack([torch.randperm(12, generator=torch.Generator().manual_seed(i))[:3] for i in range(23)])
    doc = torch.tensor([0] * 8 + [1] * 3 + [2] * 9 + [-1] * 3)
    return "balance_losses", (z.softmax(-1), z, idx, doc, 3, 0.01, 1e-3)


def _logprobs(cdtype, keep_bytes):
    """bf16 logits (the compute dtype under autocast) with fp32 statistics."""
    labels_N = torch.randint(0, 1500, (20,), generator=torch.Generator().manual_seed(3))
    return lambda: ("linear_logprobs", (_randn(23, 16), _randn(1500, 16, seed=1) * 0.5,
                                        torch.arange(2, 22), labels_N, 7, cdtype, 0.7,
                                        True, None, keep_bytes))


def _on_meta(a):
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().to("meta").requires_grad_(a.requires_grad)


def _run(name, args):
    """(outputs, gradients of every input that wants one) of triton_ops().<name>(*args)."""
    outs = getattr(triton_ops(), name)(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    return outs, torch.autograd.grad(loss, [a for a in args if isinstance(a, torch.Tensor)
                                            and a.requires_grad])


def _signature(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("case", [_rmsnorm, _add_rmsnorm, _permute, _unpermute,
                                  _router("softmax"), _router("sigmoid"), _balance,
                                  _logprobs(torch.float32, 0), _logprobs(torch.bfloat16, 1 << 20),
                                  _swiglu, _rope(False), _rope(True)],
                         ids=["rmsnorm", "add_rmsnorm", "permute", "unpermute", "router_softmax",
                              "router_sigmoid", "balance", "logprobs", "logprobs_kept_logits", "swiglu",
                              "rope", "rope_interleaved"])
def test_entry_point_on_meta_matches_interpreter_shapes(case, launches):
    name, args = case()
    outs, grads = _run(name, args)
    assert launches, "the CPU run launches its kernels"
    launches.clear()
    meta_outs, meta_grads = _run(name, [_on_meta(a) for a in args])
    assert not launches, "a meta run must not launch a kernel"
    assert all(t.device.type == "meta" for t in (*meta_outs, *meta_grads))
    assert _signature(meta_outs) == _signature(outs)
    assert len(grads) >= 1 and _signature(meta_grads) == _signature(grads)


def test_every_kernel_is_a_torch_operator():
    triton_ops()
    for name in OPS:
        assert getattr(torch.ops.longctx, name).default.name() == f"longctx::{name}"


def _opcheck_cases():
    """Each operator with inputs it accepts (the backward ones fed from a forward's outputs)."""
    L = torch.ops.longctx
    x, w, res = _randn(9, 32), _randn(32, seed=1), _randn(9, 32, dtype=torch.bfloat16, seed=2)
    _, r_N = L.rmsnorm_fwd(x, w, 1e-6, torch.float32)
    slot_TK, total = _slots()
    y = _randn(total, 64, dtype=torch.bfloat16)
    wk = torch.rand(19, 2).to(torch.bfloat16).requires_grad_()
    z, bias = _randn(37, 12), torch.linspace(-0.2, 0.2, 12)
    s, idx, wr, sums = (t.detach() for t in L.router_topk_fwd(z, bias, 3, True, True))
    s_b, z_b, idx_b, doc_b, n_b, _, _ = _balance()[1]
    s_b, z_b = s_b.detach().requires_grad_(), z_b.detach().requires_grad_()
    _, _, counts_b, tok_b = (t.detach() for t in L.balance_fwd(s_b, z_b, idx_b, doc_b, n_b, 0.01, 1e-3))
    z_CV = _randn(6, 1500, dtype=torch.bfloat16, grad=False)
    cols, own, temp = torch.randint(0, 1500, (6,)), torch.ones(6, dtype=torch.int8), torch.tensor([0.7])
    stats = [_randn(6, seed=i, grad=False) for i in range(4)]
    h = _randn(9, 80, dtype=torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)  # strided halves of one buffer, as the experts hold them
    q, k = _randn(7, 3, 13)[..., 3:], _randn(7, 1, 10, seed=1)
    cos, sin = _randn(7, 6, seed=2, grad=False), _randn(7, 6, seed=3, grad=False)
    return [
        (L.rmsnorm_fwd, (x, w, 1e-6, torch.bfloat16)),
        (L.add_rmsnorm_fwd, (x, res, w, 1e-6, torch.float32)),
        (L.rmsnorm_bwd, (_randn(9, 32, grad=False), None, x.detach(), w.detach(), r_N.detach())),
        (L.rmsnorm_bwd, (_randn(9, 32, grad=False), _randn(9, 32, grad=False, seed=3),
                         x.detach(), w.detach(), r_N.detach())),
        (L.rmsnorm_bwd, (_randn(9, 32, grad=False), None, _randn(32, 9, grad=False).t(),
                         w.detach(), r_N.detach())),  # strided x: the outputs are contiguous
        (L.add_rmsnorm_bwd, (_randn(9, 32, grad=False), _randn(9, 32, grad=False, seed=3), x.detach(),
                             w.detach(), r_N.detach(), torch.bfloat16)),
        (L.add_rmsnorm_bwd, (_randn(9, 32, grad=False), None, x.detach(), w.detach(), r_N.detach(),
                             torch.bfloat16)),
        (L.permute_fwd, (_randn(19, 64), slot_TK, total, torch.bfloat16)),
        (L.permute_bwd, (_randn(total, 64, grad=False), slot_TK, torch.float32)),
        (L.unpermute_fwd, (y, slot_TK, wk)),
        (L.unpermute_bwd, (_randn(19, 64, dtype=torch.bfloat16, grad=False), y.detach(), slot_TK,
                            wk.detach())),
        (L.router_topk_fwd, (z, bias, 3, True, True)),
        (L.router_topk_fwd, (z, None, 3, False, False)),
        (L.router_topk_fwd, (_randn(12, 37).t(), None, 3, False, True)),  # strided logits
        (L.router_topk_bwd, (_randn(37, 12, grad=False), _randn(37, 3, grad=False), s, idx, wr,
                             sums, True, True)),
        (L.route_layout, (idx_b, 12)),
        (L.route_layout, (idx_b[:0], 12)),  # no token
        (L.balance_fwd, (s_b, z_b, idx_b, doc_b, n_b, 0.01, 1e-3)),
        (L.balance_fwd, (s_b, z_b, idx_b, doc_b, n_b, 0.01, 0.0)),  # no z-loss
        (L.balance_bwd, (torch.tensor(0.5), torch.tensor(2.0), s_b.detach(), z_b.detach(), doc_b, counts_b,
                         tok_b, 3, n_b, 0.01, 1e-3)),
        (L.balance_bwd, (torch.tensor(0.5), None, s_b.detach(), z_b.detach(), doc_b, counts_b, tok_b, 3, n_b,
                         0.01, 1e-3)),
        (L.logprobs_stats, (z_CV, cols, own, temp, True)),
        (L.logprobs_grad, (z_CV.clone(), cols, own, *stats, temp, True)),
        (L.swiglu_fwd, (gate, up)),
        (L.swiglu_fwd, (_randn(5, 7), _randn(5, 7, seed=1))),  # a width under one tile
        (L.swiglu_fwd, (gate, up, 7.0)),  # gpt-oss's clamped form
        (L.swiglu_bwd, (gate.detach(), up.detach(), _randn(9, 40, dtype=torch.bfloat16, grad=False))),
        (L.swiglu_bwd, (gate.detach(), up.detach(), _randn(9, 40, dtype=torch.bfloat16, grad=False), 7.0)),
        (L.rope_fwd, (q, k, cos, sin, False)),
        (L.rope_fwd, (q, k, cos, sin, True)),
        (L.rope_bwd, (_randn(7, 3, 10, grad=False), _randn(7, 1, 10, grad=False, seed=1), cos, sin, True)),
    ]


def test_opcheck_every_operator():
    cases = _opcheck_cases()
    assert {op.default.name() for op, _ in cases} == {f"longctx::{name}" for name in OPS}
    for op, args in cases:
        torch.library.opcheck(op, args)
