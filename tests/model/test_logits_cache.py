"""The log-prob head keeps its forward's logits for the backward when they fit in
execution.loss_logits_cache_mb: the same log-probs, entropies and gradients bit for bit as
recomputing them, one fewer logits product per chunk, and the budget is honoured."""

import pytest
import torch

from longctx_moe.execution import ExecutionConfig
from longctx_moe.model import losses
from longctx_moe.model.losses import chunked_token_logprobs

T, D, V, CHUNK = 40, 16, 300, 16  # three chunks (16, 16, 8 target rows)


def _case(dtype):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(T, D, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[[0, 3, 9]] = -100
    return h, w, labels


def _run(cache_mb, dtype, entropy, temperature, autocast, twice=False):
    h, w, labels = _case(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp, ent = chunked_token_logprobs(h, w, labels, CHUNK, temperature, entropy,
                                           logits_cache_mb=cache_mb)
    g = torch.Generator().manual_seed(1)
    loss = (logp * torch.randn(T, generator=g, dtype=logp.dtype)).sum()
    if entropy:
        loss = loss + (ent * torch.randn(T, generator=g, dtype=ent.dtype)).sum()
    grads = torch.autograd.grad(loss, (h, w), retain_graph=twice)
    again = torch.autograd.grad(loss, (h, w)) if twice else ()
    return (logp, *(() if ent is None else (ent,)), *grads, *again)


def _count_logits_products(monkeypatch):
    calls = []
    real = losses._chunk_logits
    monkeypatch.setattr(losses, "_chunk_logits", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dtype,autocast", [(torch.float64, False), (torch.float32, True)])
@pytest.mark.parametrize("entropy,temperature", [(False, 1.0), (True, 0.7)])
def test_kept_logits_give_the_recomputed_results_bitwise(monkeypatch, dtype, autocast, entropy, temperature):
    calls = _count_logits_products(monkeypatch)
    recomputed = _run(0, dtype, entropy, temperature, autocast)
    assert len(calls) == 6  # three chunks, forward and backward
    calls.clear()
    kept = _run(1, dtype, entropy, temperature, autocast)
    assert len(calls) == 3  # the forward's only
    for a, b in zip(kept, recomputed, strict=True):
        assert torch.equal(a, b)


def test_the_budget_is_the_logits_size(monkeypatch):
    """37 target rows x 300 columns of float64 = 88,800 bytes: kept under a budget of that size,
    recomputed under one byte less (through the byte-level switch the MiB setting feeds)."""
    h, w, labels = _case(torch.float64)
    idx = (labels != -100).nonzero().squeeze(1)
    need = idx.numel() * V * 8
    calls = _count_logits_products(monkeypatch)
    for budget, products in ((need, 3), (need - 1, 6)):
        calls.clear()
        logp, _ = losses._LinearLogProbs.apply(h, w, idx, labels[idx], CHUNK, torch.float64, 1.0,
                                               False, None, budget)
        logp.sum().backward()
        assert len(calls) == products


def test_scoring_without_gradients_keeps_nothing(monkeypatch):
    h, w, labels = _case(torch.float64)
    calls = _count_logits_products(monkeypatch)
    with torch.no_grad():
        chunked_token_logprobs(h, w, labels, CHUNK, logits_cache_mb=1)
    assert len(calls) == 3


@pytest.mark.parametrize("dtype,autocast", [(torch.float64, False), (torch.float32, True)])
def test_a_retained_graph_backpropagates_twice_the_same(dtype, autocast):
    """Under bf16 autocast on an AVX512-BF16 CPU the fused kernel writes the gradient over the
    kept logits: the second backward must recompute them, not read the first one's gradient."""
    out = _run(1, dtype, True, 1.0, autocast, twice=True)
    first, second = out[2:4], out[4:6]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_negative_budget_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"execution.loss_logits_cache_mb=-1 must be >= 0"):
        ExecutionConfig(loss_logits_cache_mb=-1)
    h, w, labels = _case(torch.float64)
    with pytest.raises(ValueError, match="loss_logits_cache_mb"):
        chunked_token_logprobs(h, w, labels, CHUNK, logits_cache_mb=-1)
