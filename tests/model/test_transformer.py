"""Whole-model tests: document isolation, position restart, chunked cross-entropy, the trainer
API (ForwardOutput, expert bias update, param counts, FLOPs), config errors, memorisation."""

import pytest
import torch

from longctx_moe.model import ModelConfig, build_model, model_flops
from longctx_moe.model.config import BalanceConfig
from longctx_moe.model.losses import chunked_cross_entropy
from tests.model.helpers import packed_batch, tiny_config

TOL64 = 1e-10  # float64 end to end: rounding only


def _model64(balance: BalanceConfig | None = None, **overrides):
    torch.manual_seed(0)
    return build_model(tiny_config(init_std=0.2, **overrides), balance=balance).double()


@pytest.mark.parametrize("overrides", [{}, {"first_k_dense": 1, "shared_expert_hidden_size": 8,
                                            "router_score": "sigmoid", "tie_embeddings": True}])
def test_documents_are_isolated_and_positions_restart(overrides):
    model = _model64(**overrides)
    gen = torch.Generator().manual_seed(1)
    lens = [6, 1, 9, 5]
    batch = packed_batch(lens, 64, pad_multiple=4, trailing_pad=3, generator=gen)
    base = model.logits(batch)
    cup = batch.cu_seqlens_padded.tolist()
    changed = batch.tokens.clone()
    changed[cup[2]:cup[2] + lens[2]] = torch.randint(0, 64, (lens[2],), generator=gen)
    other = model.logits(packed_batch(lens, 64, pad_multiple=4, trailing_pad=3, tokens=changed))
    assert (other[cup[2]:cup[2] + lens[2]] - base[cup[2]:cup[2] + lens[2]]).abs().max() > 1e-3
    for d in (0, 1, 3):
        s = slice(cup[d], cup[d] + lens[d])
        torch.testing.assert_close(other[s], base[s], atol=TOL64, rtol=0)
    # Position restart: document 3 alone in its own row gives the same logits as inside the pack.
    alone = packed_batch([lens[3]], 64, tokens=batch.tokens[cup[3]:cup[3] + lens[3]].clone())
    torch.testing.assert_close(model.logits(alone), base[cup[3]:cup[3] + lens[3]], atol=TOL64, rtol=0)


@pytest.mark.parametrize("vocab", [50, 200000])  # 200000: several cache-sized row blocks per chunk
def test_chunked_cross_entropy_matches_full_logits(vocab):
    torch.manual_seed(0)
    h = torch.randn(23, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (23,))
    labels[[0, 5, 6, 22]] = -100
    weight = torch.rand(23, dtype=torch.float64)
    for lw in (None, weight):
        ce = chunked_cross_entropy(h, w, labels, lw, chunk_tokens=16)
        g = torch.autograd.grad(2.5 * ce, [h, w])
        per_tok = torch.nn.functional.cross_entropy(h @ w.t(), labels, reduction="none")
        ref = (per_tok if lw is None else per_tok * lw).sum()
        g_ref = torch.autograd.grad(2.5 * ref, [h, w])
        torch.testing.assert_close(ce, ref, atol=TOL64, rtol=0)
        for a, b in zip(g, g_ref, strict=True):
            torch.testing.assert_close(a, b, atol=TOL64, rtol=0)


def test_whole_chunks_as_on_gpus_give_the_cpu_blocks_results_bit_for_bit(monkeypatch):
    # On a GPU the loss works through each chunk of logits at once; on CPU in cache-sized row
    # blocks. Every op is per row, so both give the same bits: checked here on CPU, bf16 logits
    # (the autocast case) as well as float32, with loss weights.
    from longctx_moe.model import losses

    assert losses._block_rows(1000, 32768, torch.device("cuda")) == 1000
    assert losses._block_rows(1000, 32768, torch.device("cpu")) < 1000
    torch.manual_seed(0)
    h = torch.randn(300, 16, requires_grad=True)
    w = torch.randn(70000, 16, requires_grad=True)
    labels = torch.randint(0, 70000, (300,))
    weight = torch.rand(300)
    results = {}
    for mode in ("blocks", "whole"):
        if mode == "whole":
            monkeypatch.setattr(losses, "_block_rows", lambda c, v, device: c)
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                ce = chunked_cross_entropy(h, w, labels, weight, chunk_tokens=256)
            results[mode, dtype] = [ce, *torch.autograd.grad(ce, [h, w])]
    for dtype in (torch.float32, torch.bfloat16):
        for a, b in zip(results["blocks", dtype], results["whole", dtype], strict=True):
            assert torch.equal(a, b), dtype


@pytest.mark.parametrize("aux", ["seq", "switch"])
def test_scoring_without_balance_losses_skips_them_and_their_reductions_only(aux):
    from dataclasses import replace

    from longctx_moe.model.attention import doc_layout
    from longctx_moe.model.transformer import LogProbHead

    model = _model64(BalanceConfig(aux_loss_type=aux, z_loss_coeff=1e-3), first_k_dense=1, num_layers=3)
    batch = packed_batch([9, 4, 13], 64, pad_multiple=4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(batch, head=LogProbHead(entropy=True))

        def refuse(t):  # the statistics reduction of a multi-rank layout: must not be reached
            raise AssertionError("balance losses reduced over ranks while scoring")

        layout = replace(doc_layout(batch), reduce_stats=refuse)
        got = model(batch, layout, head=LogProbHead(entropy=True, balance_losses=False))
    assert float(ref.aux_loss) > 0 and float(ref.z_loss) > 0
    assert float(got.aux_loss) == 0 and float(got.z_loss) == 0
    for name in ("logprobs_T", "entropy_T", "expert_counts", "routes_TLK", "ce_sum"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


def test_forward_output_contract_and_bf16_autocast():
    cfg = tiny_config(first_k_dense=1, num_layers=3)
    torch.manual_seed(0)
    model = build_model(cfg, balance=BalanceConfig(aux_loss_type="switch"))
    batch = packed_batch([9, 4, 13], cfg.vocab_size, pad_multiple=4)
    out = model(batch)
    assert out.ce_sum.dtype == torch.float32 and out.ce_sum.shape == ()
    assert batch.num_target_tokens() == 23
    assert out.expert_counts.dtype == torch.int64 and out.expert_counts.shape == (2, cfg.num_experts)
    # Counts are over real tokens only (26 of 32 positions), top_k each.
    assert out.expert_counts.sum(1).tolist() == [26 * cfg.top_k] * 2
    assert out.aux_loss > 0 and out.z_loss > 0
    full = torch.nn.functional.cross_entropy(model.logits(batch), batch.labels, reduction="sum")
    torch.testing.assert_close(out.ce_sum, full, atol=1e-4, rtol=1e-5)  # fp32, summation order
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf = model(batch)
    (bf.ce_sum / 23 + bf.aux_loss + bf.z_loss).backward()
    # bf16 matmuls (8-bit mantissa) over a random-init model: the mean CE agrees to ~1%.
    assert abs(bf.ce_sum.item() - out.ce_sum.item()) / out.ce_sum.item() < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_build_is_deterministic_and_counts_params():
    cfg = tiny_config(shared_expert_hidden_size=8)
    torch.manual_seed(3)
    a = build_model(cfg)
    torch.manual_seed(3)
    b = build_model(cfg)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    d, v, e, f = 32, 64, 4, 16
    attn = d * 8 * (2 * 4 + 2 * 2) + 2 * 8  # q,o: 4 heads of 8; k,v: 2 heads; q/k norms
    moe = e * d + e * 3 * d * f + 3 * d * 8
    per_layer = attn + moe + 2 * d
    assert sum(p.numel() for p in a.parameters()) == 2 * v * d + 2 * per_layer + d  # embed + head


def test_update_expert_bias_and_flops():
    model = _model64(BalanceConfig(expert_bias_update_rate=0.5), expert_bias=True, first_k_dense=1, num_layers=3)
    counts = torch.tensor([[9, 1, 5, 5], [0, 0, 0, 20]])
    model.update_expert_bias(counts)
    biases = [layer.router.expert_bias.tolist() for layer in model.moe_layers()]
    assert biases == [[-0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.5, -0.5]]
    with pytest.raises(ValueError, match="num_moe_layers=2"):
        model.update_expert_bias(counts[:1])
    cfg = model.cfg
    d = cfg.hidden_size
    dense = 3 * d * cfg.dense_hidden_size
    moe = d * 4 + 2 * 3 * d * cfg.expert_hidden_size
    attn = d * 8 * 12
    n_active = 3 * attn + dense + 2 * moe + d * cfg.vocab_size
    lens = [5, 1, 10]
    attention = 12 * (15 + 1 + 55) * 4 * 8 * 3
    assert model_flops(cfg, lens) == 6 * n_active * 16 + attention


def test_mla_flops_count_the_attention_weights_the_model_has():
    """MLA's projections (low-rank q, kv latent with the shared rope key, per-head up-projection)
    counted from the built model's own attention weights; the pair cost from the q/k and v head
    sizes, which differ (QK^T over nope + rope dims, PV over v dims)."""
    from longctx_moe.model.flops import active_matmul_params

    cfg = tiny_config(attention_type="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                      qk_rope_head_dim=4, v_head_dim=5, qk_norm=False, num_kv_heads=4)
    model = build_model(cfg)
    attn = sum(p.numel() for n, p in model.named_parameters()
               if ".attn." in n and n.endswith(("proj.weight", "proj_with_mqa.weight")))
    rest = active_matmul_params(tiny_config(num_kv_heads=4)) - cfg.num_layers * cfg.hidden_size * 8 * 16
    assert active_matmul_params(cfg) == attn + rest
    pairs = 3 + 10  # documents of 2 and 4 tokens
    per_pair = 3 * 2 * cfg.num_heads * ((6 + 4) + 5) * cfg.num_layers
    assert model_flops(cfg, [2, 4]) == 6 * active_matmul_params(cfg) * 6 + per_pair * pairs


@pytest.mark.parametrize("key,value,match", [("router_score", "relu", "model.router_score"),
                                             ("num_kv_heads", 3, "model.num_kv_heads=3"),
                                             ("top_k", 9, "model.top_k=9"),
                                             ("max_position_embeddings", 0, "model.max_position_embeddings=0")])
def test_bad_config_names_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        build_model(ModelConfig(**{key: value}))


@pytest.mark.parametrize("key,value,match", [("aux_loss_type", "global", "balance.aux_loss_type"),
                                             ("aux_loss_coeff", -0.1, "balance.aux_loss_coeff=-0.1"),
                                             ("expert_bias_update_rate", -1.0, "balance.expert_bias_update_rate")])
def test_bad_balance_names_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        BalanceConfig(**{key: value})


def test_memorises_one_packed_batch():
    torch.manual_seed(0)
    cfg = tiny_config(init_std=0.05)
    model = build_model(cfg, balance=BalanceConfig(aux_loss_type="switch"))
    batch = packed_batch([20, 7, 30, 5], cfg.vocab_size, pad_multiple=4,
                         generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(300):
        out = model(batch)
        loss = out.ce_sum / batch.num_target_tokens()
        (loss + out.aux_loss + out.z_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if loss.item() < 0.05:
            break
    assert loss.item() < 0.1


@pytest.mark.parametrize("aux", ["seq", "switch"])
def test_all_padding_row_and_empty_documents(aux):
    from data_packing.batch import PackedBatch

    torch.manual_seed(0)
    model = build_model(tiny_config(), balance=BalanceConfig(aux_loss_type=aux))
    z = torch.zeros(8, dtype=torch.long)
    pad_only = PackedBatch(tokens=z, labels=torch.full((8,), -100), position_ids=z, max_seqlen=0,
                           cu_seqlens=torch.tensor([0, 0], dtype=torch.int32),
                           cu_seqlens_padded=torch.tensor([0, 8], dtype=torch.int32))
    out = model(pad_only)
    assert pad_only.num_target_tokens() == 0 and out.ce_sum.item() == 0.0 and out.aux_loss.item() == 0.0
    assert out.expert_counts.sum() == 0
    (out.ce_sum + out.aux_loss + out.z_loss).backward()
    batch = packed_batch([0, 5, 0, 1], 64, pad_multiple=4)  # empty documents in the row
    out = model(batch)
    assert batch.num_target_tokens() == 4 and out.expert_counts.sum(1).tolist() == [12, 12]
    assert torch.isfinite(out.ce_sum) and torch.isfinite(out.aux_loss)
