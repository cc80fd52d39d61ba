"""Dynamic-CP's cost model with a value head size apart from the query/key size (MLA): FLOPs per
query-key pair and bytes per token written out from what the kernels compute and the CP
executors send, not from the cost model's own helpers."""

import pytest

from cp_attention.dynamic_cost import DynamicCPCost

# DeepSeek-V3's attention: 61 layers, 128 heads, q/k heads of 128 nope + 64 rope dims, v heads
# of 128, bf16; every head has its own K and V after kv_b, so 128 K/V heads travel.
LAYERS, HEADS, NOPE, ROPE, V, ITEM = 61, 128, 128, 64, 128, 2
QK = NOPE + ROPE
FLOPS, ATTN_FLOPS, BW = 400e12, 300e12, 200e9


def _mla(**kw) -> DynamicCPCost:
    return DynamicCPCost.from_model(num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS,
                                    head_dim=QK, v_head_dim=V, active_params_per_token=37e9,
                                    flops_per_s=FLOPS, attention_flops_per_s=ATTN_FLOPS,
                                    bandwidth=BW, itemsize=ITEM, **kw)


def _pair_flops_per_layer() -> int:
    """Training FLOPs of one query-key pair in one layer, all heads."""
    qk_t = 2 * QK  # one score: a dot product over the q/k size
    pv = 2 * V  # one weighted value row over the v size
    forward = HEADS * (qk_t + pv)
    # backward: dV = P^T dO and dP = dO V^T over the v size, dQ = dS K and dK = dS^T Q over the
    # q/k size: twice the forward
    backward = HEADS * (2 * 2 * V + 2 * 2 * QK)
    return forward + backward


def test_mla_pair_flops_split_qk_and_v_sizes():
    per_layer = _pair_flops_per_layer()
    assert per_layer == 3 * 128 * (2 * 192 + 2 * 128)  # 245760
    cost = _mla()
    # b: seconds per n^2 (causal half) over all layers at the attention throughput
    assert cost.b == pytest.approx(per_layer * LAYERS / 2 / ATTN_FLOPS, rel=1e-15)
    n = 4096
    assert cost.compute_seconds(n, 1) - cost.a * n == pytest.approx(
        per_layer * LAYERS * n * n / 2 / ATTN_FLOPS, rel=1e-12)


def test_mla_ring_bytes_per_token_are_k_and_v_of_every_head():
    # forward: K (q/k size) | V (v size) of each head; backward: the same block again plus its
    # dK | dV travelling with it
    kv_block = HEADS * (QK + V) * ITEM
    per_layer = kv_block + kv_block + kv_block
    assert per_layer == 245760
    cost = _mla()
    assert cost.kv_bytes_per_token == per_layer * LAYERS
    for n, s in ((8192, 2), (8192, 8)):
        assert cost.ring_bytes(n, s) == pytest.approx((s - 1) / s * n * per_layer * LAYERS,
                                                       rel=1e-12)


@pytest.mark.parametrize("g", [2, 4, 8])
def test_mla_all_to_all_bytes_per_rank(g):
    """Ulysses over g ranks, each holding n / g tokens, keeps 1/g of every tensor it exchanges:
    forward Q, K, V scattered and out gathered; backward dout scattered, dQ, dK, dV gathered."""
    forward = HEADS * (QK + QK + V + V) * ITEM  # Q, K, V, out
    backward = HEADS * (V + QK + QK + V) * ITEM  # dout, dQ, dK, dV
    n = 1024 * g
    want = (g - 1) / g * (n / g) * (forward + backward) * LAYERS
    cost = _mla(a2a_size=g)
    assert cost.a2a_bytes(n, g) == pytest.approx(want, rel=1e-12)
    assert cost.ring_bytes(n, g) == 0  # one all-to-all group: no ring


def test_windowed_and_full_layers_mix_by_count():
    """Alternating sliding / full layers: each windowed layer costs its window pairs, each full
    layer the causal square, whatever their order."""
    window, n, s = 128, 4096, 2
    windowed = LAYERS // 2
    cost = _mla(window_layers=windowed, window=window)
    pairs_windowed = sum(min(i + 1, window) for i in range(n))
    pairs_full = n * n / 2
    attn = _pair_flops_per_layer() * (windowed * pairs_windowed
                                      + (LAYERS - windowed) * pairs_full) / ATTN_FLOPS
    assert cost.compute_seconds(n, s) == pytest.approx((cost.a * n + attn) / s, rel=1e-12)
    # the ring sends the same blocks with or without a window
    assert cost.kv_bytes_per_token == _mla().kv_bytes_per_token


def test_one_head_size_costs_as_before():
    """GQA: v_head_dim omitted or equal to head_dim gives the same constants, and they are the
    4 * heads * head_dim FLOPs per pair and layer and 3 * 2 * kv_heads * head_dim bytes."""
    kw = dict(num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
              active_params_per_token=3.3e9, flops_per_s=FLOPS, bandwidth=BW, a2a_size=4,
              window_layers=24, window=4096)
    gqa = DynamicCPCost.from_model(**kw)
    assert DynamicCPCost.from_model(**kw, v_head_dim=128) == gqa
    per_pair = 3 * 4 * 32 * 128 / FLOPS
    assert gqa.b == per_pair * 24 / 2 and gqa.c_window == per_pair * 24
    assert gqa.kv_bytes_per_token == 3 * 2 * 4 * 128 * 2 * 48
    assert gqa.q_bytes_per_token == 4 * 32 * 128 * 2 * 48
    assert gqa.kv_heads == 4
