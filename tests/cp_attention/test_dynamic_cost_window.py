"""Dynamic-CP's cost model counts sliding-window layers by the pairs they compute."""

import numpy as np
import pytest

from cp_attention.dynamic_cost import DynamicCPCost


def _brute_pairs(n, w):
    return sum(min(i + 1, w) for i in range(n))


@pytest.mark.parametrize("n", [1, 5, 128, 129, 1000])
def test_window_pairs_count_each_querys_visible_keys(n):
    cost = DynamicCPCost(a=0.0, b=0.0, c_window=1.0, window=128)
    assert cost.window_pairs(n) == _brute_pairs(n, 128)


def test_window_pairs_of_an_array_of_lengths_elementwise():
    """The scheduler costs arrays of sequence lengths at once (a windowed model under
    Dynamic-CP): lengths below and above the window in one array."""
    cost = DynamicCPCost(a=0.0, b=0.0, c_window=1.0, window=128)
    lengths = np.array([1, 5, 128, 129, 1000])
    want = [_brute_pairs(int(n), 128) for n in lengths]
    assert cost.window_pairs(lengths).tolist() == want
    assert cost.compute_seconds(lengths, 2).tolist() == [w / 2 for w in want]


def test_windowed_layers_cost_their_pairs_not_the_causal_square():
    kw = dict(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, active_params_per_token=1e6,
              flops_per_s=1e12, bandwidth=1e11)
    full = DynamicCPCost.from_model(**kw)
    half = DynamicCPCost.from_model(**kw, window_layers=2, window=128)
    n = 8192
    per_pair_layer = 3.0 * 4 * 8 * 64 / 1e12
    # the two windowed layers cost their window pairs; the two full layers keep the n^2 / 2 term
    want = full.compute_seconds(n, 2) - per_pair_layer * 2 * (n * n / 2 - _brute_pairs(n, 128)) / 2
    assert half.compute_seconds(n, 2) == pytest.approx(want, rel=1e-12)
    assert DynamicCPCost.from_model(**kw, window_layers=2, window=0) == full  # no window: none
