"""Document bounds stay on the host: a micro-batch's layout (and its CP shard's) is planned there
and only its results go to the tokens' device.

The token tensors live on `meta` (no storage): reading any value of a meta tensor on the host
(.item(), .tolist(), bool(), int(), .cpu(), nonzero) raises, so a layout built and a forward run
through on them prove that neither reads a device value back (on a GPU: no sync).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cp_attention.kernels import AttnKernel
from data_packing.batch import PackedBatch
from longctx_moe.execution import Ops
from longctx_moe.model import Transformer
from longctx_moe.model.attention import doc_layout
from longctx_moe.parallel.context_parallel import CPGroup, shard_for_cp
from tests.model.helpers import packed_batch, tiny_config

DOCS = [5, 3, 7]


def _host_batch() -> PackedBatch:
    return packed_batch(DOCS, 64, pad_multiple=4, trailing_pad=3, generator=torch.Generator().manual_seed(0))


def test_to_moves_the_tokens_and_keeps_the_bounds_on_the_host():
    host = _host_batch()
    moved = host.to("meta")
    assert moved.tokens.is_meta and moved.labels.is_meta and moved.position_ids.is_meta
    assert moved.cu_seqlens is host.cu_seqlens and moved.cu_seqlens_padded is host.cu_seqlens_padded
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        dataclasses.replace(host, cu_seqlens=host.cu_seqlens.to("meta"))


def test_the_layout_of_a_meta_batch_equals_the_host_one_on_the_device():
    host = _host_batch()
    want, got = doc_layout(host), doc_layout(host.to("meta"))
    assert got.cu_attn_host_S.device.type == "cpu"
    assert torch.equal(got.cu_attn_host_S, want.cu_attn_S)
    assert got.cu_attn_S.is_meta and got.cu_attn_S.dtype == torch.int32
    assert got.cu_attn_S.shape == want.cu_attn_S.shape
    assert got.doc_id_T.is_meta and got.doc_id_T.shape == want.doc_id_T.shape
    assert got.real_mask_T.is_meta and got.real_mask_T.shape == want.real_mask_T.shape
    assert (got.max_attn, got.num_docs) == (want.max_attn, want.num_docs) == (7, 3)
    # On the host the kernels' copy is the planning copy: nothing is copied twice.
    assert want.cu_attn_host_S is want.cu_attn_S


def test_a_forward_and_backward_on_meta_read_nothing_back():
    # Dense layers only: the MoE layers' own host reads (routing counts) are out of this test's
    # scope. torch_varlen, as resolved for a CUDA run, has a meta kernel in torch.
    cfg = tiny_config(first_k_dense=2)
    with torch.device("meta"):
        model = Transformer(cfg, Ops(attention=AttnKernel("torch_varlen"))).to(torch.bfloat16)
    batch = _host_batch().to("meta")
    h_TD = model.hidden_states(batch, doc_layout(batch))
    assert h_TD.is_meta and h_TD.shape == (batch.num_tokens, cfg.hidden_size)
    h_TD.float().sum().backward()
    assert model.layers[0].attn.wq.weight.grad.is_meta


@pytest.mark.parametrize("rank", [0, 1])
def test_a_cp_shard_of_a_meta_batch_is_planned_on_the_host(rank):
    host = _host_batch()
    cp = CPGroup(size=2, rank=rank)  # planning and sharding only: no collective runs
    want, want_layout, _ = shard_for_cp(host, cp)
    local, layout, plan = shard_for_cp(host.to("meta"), cp)
    assert local.tokens.is_meta and local.tokens.shape == want.tokens.shape
    assert local.cu_seqlens.device.type == "cpu"
    assert torch.equal(local.cu_seqlens, want.cu_seqlens)
    assert torch.equal(local.cu_seqlens_padded, want.cu_seqlens_padded)
    assert torch.equal(layout.cu_attn_host_S, want_layout.cu_attn_S)
    assert layout.doc_id_T.is_meta and layout.real_mask_T.is_meta
    assert layout.num_docs == len(DOCS) and plan.local_tokens(rank) == local.num_tokens
