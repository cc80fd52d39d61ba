"""The Dynamic-CP cost model the runtime builds from a model config (parallelize._dynamic_cp) has
the head sizes and head counts that the attention actually computes with and the CP executors
actually send: MLA's q/k and v sizes and its per-head K and V, GQA's shared KV heads."""

import pytest

from longctx_moe.model import build_model
from longctx_moe.model.flops import active_matmul_params
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.parallelize import _dynamic_cp
from tests.model.helpers import tiny_config

MLA = dict(attention_type="mla", kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
           v_head_dim=5, qk_norm=False, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)
TFLOPS, GBPS = 100.0, 50.0


def _cost(backend: str = "ring", **model):
    cfg = tiny_config(**model)
    cfg.validate()
    layout = ParallelConfig(dynamic_cp=True, max_tokens_per_rank=64, dcp_tflops=TFLOPS,
                            dcp_bandwidth_gbps=GBPS, cp_backend=backend)
    dims = ParallelDims.from_config(layout, 1)
    dims.build_groups(0)
    return cfg, _dynamic_cp(build_model(cfg), dims, layout, 64).cost


def test_mla_cost_uses_qk_and_v_head_sizes_and_a_kv_head_per_head():
    cfg, cost = _cost(**MLA)
    heads, qk, v, layers, item = 4, 6 + 4, 5, 4, 2
    # per pair and layer: QK^T 2*qk and PV 2*v FLOPs per head, x3 with the backward;
    # not 4 * head_dim (8) per head
    per_pair = 3 * heads * (2 * qk + 2 * v)
    assert per_pair == 360
    assert cost.b == pytest.approx(per_pair * layers / 2 / (TFLOPS * 1e12), rel=1e-15)
    # ring: K | V of all 4 heads (not the config's 2 GQA KV heads), forward, backward, dK | dV
    assert cost.kv_bytes_per_token == 3 * heads * (qk + v) * item * layers == 1440
    assert cost.kv_heads == heads
    # all-to-all: Q, dQ of the q/k size, out, dout of the v size
    assert cost.q_bytes_per_token == heads * (qk + v + v + qk) * item * layers == 960
    assert cost.a == pytest.approx(6 * active_matmul_params(cfg) / (TFLOPS * 1e12), rel=1e-15)
    assert cost.bandwidth == GBPS * 1e9


def test_mla_alternating_sliding_and_full_layers():
    window = 16
    types = ["sliding_attention", "full_attention"] * 2
    _, cost = _cost(**MLA, sliding_window=window, layer_types=types)
    per_pair = 3 * 4 * (2 * 10 + 2 * 5) / (TFLOPS * 1e12)
    assert cost.b == pytest.approx(per_pair * 2 / 2, rel=1e-15)  # the two full layers
    assert cost.c_window == pytest.approx(per_pair * 2, rel=1e-15)  # the two windowed ones
    assert cost.window == window
    n = 100
    layers = [sum(min(i + 1, window) for i in range(n)) if t == "sliding_attention" else n * n / 2
              for t in types]
    split = (cost.a * n + per_pair * sum(layers)) / 2  # work shared by the 2 ranks
    tiles = per_pair * 2 / 2 * n * cost.attn_half_tokens  # the full layers' short-tile loss
    assert cost.compute_seconds(n, 2) == pytest.approx(split + tiles, rel=1e-12)


def test_gqa_cost_is_unchanged():
    """A GQA model: 4 * heads * head_dim FLOPs per pair and layer, its KV heads on the ring."""
    _, cost = _cost("ulysses", num_heads=4, num_kv_heads=2, head_dim=8, num_layers=2)
    assert cost.b == pytest.approx(3 * 4 * 4 * 8 * 2 / 2 / (TFLOPS * 1e12), rel=1e-15)
    assert cost.kv_bytes_per_token == 3 * 2 * 2 * 8 * 2 * 2
    assert cost.q_bytes_per_token == 4 * 4 * 8 * 2 * 2
    assert cost.kv_heads == 2
