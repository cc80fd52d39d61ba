"""Shared helpers for the model tests: random packed batches, tiny configs, a dense reference."""

from __future__ import annotations

import torch

from data_packing.batch import PackedBatch, labels_from_tokens, position_ids_from_cu
from longctx_moe.execution import ExecutionConfig, Ops, Target, resolve
from longctx_moe.model.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                num_experts=4, top_k=2, expert_hidden_size=16, dense_hidden_size=32)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_ops(recompute: str = "none", compute: torch.dtype = torch.float32, **overrides) -> Ops:
    """The Ops of a CPU run computing in `compute` with execution.* `overrides` and
    train.recompute=`recompute`; the loss in chunks of 7 tokens so that the tiny batches span
    several chunks."""
    return resolve(ExecutionConfig(**{"loss_chunk_tokens": 7, **overrides}),
                   Target("cpu", compute, torch.float32), recompute)


def packed_batch(doc_lens: list[int], vocab: int, pad_multiple: int = 1, trailing_pad: int = 0,
                 generator: torch.Generator | None = None, tokens: torch.Tensor | None = None) -> PackedBatch:
    """A PackedBatch of random documents; each slot padded to pad_multiple, plus trailing padding."""
    slots = [-(-n // pad_multiple) * pad_multiple if n else pad_multiple for n in doc_lens]
    cu = torch.tensor([0] + doc_lens).cumsum(0).to(torch.int32)
    cup = torch.tensor([0] + slots).cumsum(0).to(torch.int32)
    total = int(cup[-1]) + trailing_pad
    if tokens is None:
        tokens = torch.randint(0, vocab, (total,), generator=generator)
    pos = position_ids_from_cu(cu, cup, total)
    real = torch.zeros(total, dtype=torch.bool)
    for s, n in zip(cup[:-1].tolist(), doc_lens, strict=True):
        real[s:s + n] = True
    tokens = torch.where(real, tokens, torch.zeros_like(tokens))  # pad id 0
    return PackedBatch(tokens=tokens, labels=labels_from_tokens(tokens, cu, cup), cu_seqlens=cu,
                       cu_seqlens_padded=cup, position_ids=pos, max_seqlen=max(doc_lens, default=0))


def dense_attention(q_THR, k_TGR, v_TGR, cu_S, scale=None):
    """Naive masked attention: token i sees token j iff same segment of cu_S and j <= i."""
    t, h, r = q_THR.shape
    k = k_TGR.repeat_interleave(h // k_TGR.shape[1], dim=1)
    v = v_TGR.repeat_interleave(h // v_TGR.shape[1], dim=1)
    seg_T = torch.bucketize(torch.arange(t), cu_S[1:].long(), right=True)
    idx = torch.arange(t)
    allowed_TT = (seg_T[:, None] == seg_T[None, :]) & (idx[None, :] <= idx[:, None])
    s_HTT = torch.einsum("thr,shr->hts", q_THR, k) * (scale or r ** -0.5)
    s_HTT = s_HTT.masked_fill(~allowed_TT, float("-inf"))
    return torch.einsum("hts,shr->thr", s_HTT.softmax(-1), v)
