"""The Dynamic-CP scheduler's cost model (cp_attention.dynamic): what one sequence costs each
rank of a context-parallel run, and what a run costs whatever it holds.

API
    cost = DynamicCPCost(a, b, kv_bytes_per_token, bandwidth, overlap, ring_step_seconds,
                         attn_half_tokens)
    cost = DynamicCPCost.h100()   or   DynamicCPCost.from_model(num_layers=..., ...)
    padded_length(n, size, tp, sequence_parallel)   physical length of a sequence on `size` ranks
    fit_attention_efficiency(lengths, flops_per_s) -> (long-tile FLOP/s, n_half)

Cost model (DynamicCPCost). A sequence of padded length n on s ranks costs every one of them
    (a*n + b*n^2 / eff(n/s)) / s  +  ((1 - overlap) * ring_bytes + a2a_bytes) / bandwidth  seconds.
The run exchanges heads by all-to-all over its first g = min(s, a2a_size) ranks (Ulysses; the
inner level of hierarchical CP) and runs a ring over the remaining r = s / g (ring CP: g = 1):
    ring_bytes = (r-1)/r * n * kv_bytes_per_token * k/K      (each rank receives the K, V of the
                                                             tokens it does not hold, forward K, V
                                                             and backward K, V, dK, dV)
    a2a_bytes  = (g-1)/g * n/s * (q_bytes_per_token + 2/3 * kv_bytes_per_token * max(K, g)/K)
with K KV heads and k = max(K, g)/g the KV heads one rank holds after the all-to-all (fewer KV
heads than g are replicated up to g first); a2a_bytes counts Q, out forward and dout, dQ
backward, plus K, V forward and dK, dV backward, each rank keeping 1/g of them. The ring hides
`overlap` of its transfer behind the attention of the block before it; the all-to-all hides
nothing (attention waits for its heads). eff(m) = m / (m + n_half) is the attention kernel's tile efficiency at m tokens
per rank (the half-performance length n_half: short tiles run far below peak), so the attention
term is b*n^2/s + b*n*n_half: the second part, the tile overhead, is paid by every rank of the
run, whatever s. A run of s ranks busy in a slot costs each of its ranks ring_step_seconds *
(r - 1 + 2 [g > 1]) more, once (the fixed cost of its r - 1 ring steps and of the all-to-alls
before and after attention, each charged as one step: one ring carries all the run's sequences).
Padding is computed and sent like real tokens, so costs use the padded length. With n_half = 0
and ring_step_seconds = 0 (the dataclass defaults) compute divides evenly over any s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data_packing.balance import token_pair_cost
from data_packing.batch import pad_multiple, pad_to


def padded_length(n: int, size: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Length of a sequence of n tokens on a run of `size` ranks, padded as the runtime pads it:
    to data_packing.batch.pad_multiple (2*size zigzag chunks, split TP ways with sequence
    parallelism)."""
    return pad_to(n, pad_multiple(size, tp, sequence_parallel))


# H100-class constants of the two terms the plain compute + bytes model leaves out (cited in
# docs/PERFORMANCE.md, Dynamic-CP). Ring-step latency: NCCL's own tuning model
# (src/graph/tuning.cc) puts a Simple-protocol p2p hop at baseLat 8.4 us + hwLat 3.4 us over
# NVLink (14 us over the network): ~12 us in a node, ~22 us across nodes; the attention kernel
# launches and the merge of each step come on top, so these are low estimates. n_half: the
# least-squares fit of eff(L) = L / (L + n_half) to FlashAttention-3's bf16 head-dim-128
# forward (causal) + backward TFLOP/s on H100 SXM5 at sequence lengths 512..16K (Shah et al.
# 2024, arXiv:2407.08608, speed figures; fwd:bwd FLOPs 1:2.5): n_half ~ 490 tokens, within 4%
# of every point.
H100_RING_LATENCY = 12e-6
H100_IB_RING_LATENCY = 22e-6
H100_ATTN_HALF_TOKENS = 490.0


@dataclass(frozen=True)
class DynamicCPCost:
    """Seconds one sequence costs each rank of its run, and the fixed seconds of a run (module
    docstring: cost model).

    a: seconds per token computed (GEMMs: attention projections, router, active experts, LM
       head; forward + backward). b: seconds per n^2 of one sequence's attention at full tile
       efficiency, causal half and forward + backward folded in. kv_bytes_per_token: ring bytes
       per token of one sequence, all layers, forward K,V + backward K,V + dK,dV, i.e. 3 *
       kv_heads * (qk_dim + v_dim) * itemsize * layers (qk_dim the query/key head size, v_dim
       the value head size; both head_dim without MLA). bandwidth: bytes/s one rank receives
       on the ring. overlap: fraction of the ring time hidden behind compute (0: none, 1: all).
    ring_step_seconds: fixed cost of one ring step (kernel launches, p2p latency, the wait that
       ends the step) summed over one micro-batch's ring passes, i.e. 2 * layers * the latency
       of one step (forward and backward of every layer); a run of s ranks pays it s - 1 times,
       once per run and slot whatever it holds (one ring carries all its sequences). 0: none.
    attn_half_tokens: n_half of the attention tile efficiency eff(m) = m / (m + n_half), m the
       tokens one rank holds of the sequence (n / s): the classic half-performance length, the
       tile length at which attention runs at half its long-tile throughput. 0: eff = 1.
    a2a_size: the most ranks of a run that exchange heads by all-to-all (1: ring CP; the run
       size for Ulysses; the inner size for hierarchical CP). q_bytes_per_token: all-to-all
       bytes per token of the query-sized tensors, all layers (Q, out forward, dout, dQ
       backward: 2 * heads * (qk_dim + v_dim) * itemsize * layers). kv_heads: KV heads of the model
       (replication when a2a_size exceeds them).
    """

    a: float
    b: float
    kv_bytes_per_token: float = 0.0
    bandwidth: float = math.inf
    overlap: float = 0.0
    ring_step_seconds: float = 0.0
    attn_half_tokens: float = 0.0
    a2a_size: int = 1
    q_bytes_per_token: float = 0.0
    kv_heads: int = 1
    c_window: float = 0.0
    window: int = 0

    def __post_init__(self):
        if min(self.a, self.b, self.kv_bytes_per_token, self.ring_step_seconds,
               self.attn_half_tokens, self.q_bytes_per_token) < 0 or not self.bandwidth > 0 \
                or not 0.0 <= self.overlap <= 1.0 or not math.isfinite(self.ring_step_seconds) \
                or not math.isfinite(self.attn_half_tokens) or self.kv_heads < 1 \
                or self.a2a_size < 1 or self.a2a_size & (self.a2a_size - 1):
            raise ValueError(f"DynamicCPCost: need a, b, kv_bytes_per_token, q_bytes_per_token, "
                             f"ring_step_seconds, attn_half_tokens >= 0 (the last two finite), "
                             f"bandwidth > 0, 0 <= overlap <= 1, kv_heads >= 1 and a2a_size a "
                             f"power of two; got {self}")

    def attention_efficiency(self, tokens_per_rank):
        """eff(m) = m / (m + n_half) in (0, 1], increasing in m; 1 without n_half."""
        if self.attn_half_tokens == 0:
            return 1.0 + 0.0 * tokens_per_rank
        return tokens_per_rank / (tokens_per_rank + self.attn_half_tokens)

    def compute_seconds(self, n, size: int):
        """(a*n + b*n^2 / eff(n/size)) / size = (a*n + b*n^2) / size + b*n*n_half: the
        inefficiency of short tiles costs every rank of the run b*n*n_half, whatever its size;
        plus the windowed layers' pairs (window_pairs) split over the run."""
        # b is per n^2 (half a causal pair's seconds: n^2 / 2 pairs)
        return ((token_pair_cost(n, n * n, self.a, self.b) + self.c_window * self.window_pairs(n)) / size
                + self.b * n * self.attn_half_tokens)

    def window_pairs(self, n):
        """Query-key pairs of one windowed layer over a sequence of n tokens (0 without one)."""
        w = self.window
        if w <= 0:
            return 0.0 * n
        # Query i sees min(i + 1, w) keys. m = min(n, w) written so that it also holds
        # elementwise for the arrays of lengths the scheduler passes (no branch on n).
        m = (n + w - abs(n - w)) / 2
        return m * (m + 1) / 2 + w * (n - m)

    def split(self, size: int) -> tuple[int, int]:
        """(g, r): a run of `size` ranks exchanges heads over g = min(size, a2a_size) ranks and
        runs a ring over r = size / g."""
        g = min(size, self.a2a_size)
        return g, size // g

    def ring_bytes(self, n, size: int):
        """Ring bytes each of the `size` ranks receives for one sequence of padded length n."""
        g, r = self.split(size)
        held = max(self.kv_heads, g) / g / self.kv_heads  # share of the KV heads one rank holds
        return (r - 1) / r * n * self.kv_bytes_per_token * held

    def a2a_bytes(self, n, size: int):
        """All-to-all bytes each of the `size` ranks receives for one sequence of padded length
        n (0 for ring CP)."""
        g, _ = self.split(size)
        kv = 2.0 / 3.0 * self.kv_bytes_per_token * max(self.kv_heads, g) / self.kv_heads
        return (g - 1) / g * n / size * (self.q_bytes_per_token + kv)

    def cp_bytes(self, n, size: int):
        """All CP bytes each of the `size` ranks receives for one sequence of padded length n."""
        return self.ring_bytes(n, size) + self.a2a_bytes(n, size)

    def comm_seconds(self, n, size: int):
        """Unhidden CP transfer seconds of one sequence of padded length n for each rank of a run
        of `size`: the ring's share not behind attention, and the whole all-to-all."""
        return ((1.0 - self.overlap) * self.ring_bytes(n, size) + self.a2a_bytes(n, size)) \
            / self.bandwidth

    def seconds(self, n, size: int):
        """Seconds one sequence of padded length n adds to each rank of a run of `size`."""
        return self.compute_seconds(n, size) + self.comm_seconds(n, size)

    def run_fixed_seconds(self, size: int) -> float:
        """Fixed seconds of a run of `size` ranks that holds at least one sequence in a slot:
        its r - 1 ring steps and, with an all-to-all, the two around attention."""
        g, r = self.split(size)
        return self.ring_step_seconds * (r - 1 + (2 if g > 1 else 0))

    def run_seconds(self, padded_lengths, size: int) -> float:
        """Seconds of a run of `size` ranks holding sequences of these padded lengths (0 if
        none): its fixed ring-step cost plus every sequence's seconds."""
        padded_lengths = list(padded_lengths)
        if not padded_lengths:
            return 0.0
        return self.run_fixed_seconds(size) + sum(self.seconds(n, size) for n in padded_lengths)

    @classmethod
    def from_model(cls, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   active_params_per_token: float, flops_per_s: float, bandwidth: float,
                   attention_flops_per_s: float | None = None, itemsize: int = 2,
                   overlap: float = 0.5, ring_latency: float = 0.0,
                   attn_half_tokens: float = 0.0, a2a_size: int = 1,
                   window_layers: int = 0, window: int = 0,
                   v_head_dim: int | None = None) -> DynamicCPCost:
        """Constants from a model description and achieved (not peak) throughputs.

        head_dim is the query/key head size, v_head_dim the value (and output) head size
        (None: head_dim); num_kv_heads the K/V heads the CP executors move (MLA: num_heads, K and
        V per head after the kv_b up-projection). a = 6 * active matmul params / flops_per_s
        (2 FLOPs per multiply-add, backward twice the forward). b: attention does 2 * heads *
        (head_dim + v_head_dim) FLOPs per query-key pair and layer forward (QK^T over the q/k
        size, PV over the v size), times 3 with the backward, over n^2/2 causal pairs, at
        attention_flops_per_s (default flops_per_s), the throughput on long tiles (the backward's
        dV and dP use the v size, dQ and dK the q/k size: twice the forward either way). The hidden
        size does not enter: it is inside active_params_per_token and, for attention, the head
        sizes. ring_latency: seconds of one ring step (one p2p exchange with its launch and
        wait); every layer runs one ring forward and one backward, so ring_step_seconds = 2 *
        num_layers * ring_latency. attn_half_tokens: the tile efficiency's n_half. a2a_size:
        1 for ring CP, the largest run for Ulysses, the inner size for hierarchical CP.
        window_layers of the layers attend in a sliding window of `window` keys (c_window), the
        others over the causal square (b); ring and all-to-all bytes count every layer, as the
        executors send the same messages with or without a window.
        """
        attn = attention_flops_per_s or flops_per_s
        qk_v = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        per_pair = 3.0 * 2 * num_heads * qk_v / attn  # one layer, one pair, fwd + bwd
        window_layers = window_layers if window > 0 else 0
        return cls(a=6.0 * active_params_per_token / flops_per_s,
                   b=per_pair * (num_layers - window_layers) / 2,
                   c_window=per_pair * window_layers, window=window if window_layers else 0,
                   kv_bytes_per_token=_kv_bytes_per_token(num_kv_heads, qk_v, itemsize, num_layers),
                   bandwidth=bandwidth, overlap=overlap,
                   ring_step_seconds=2.0 * num_layers * ring_latency,
                   attn_half_tokens=attn_half_tokens, a2a_size=a2a_size,
                   q_bytes_per_token=_q_bytes_per_token(num_heads, qk_v, itemsize, num_layers),
                   kv_heads=num_kv_heads)

    @classmethod
    def h100(cls, bandwidth: float = 200e9, overlap: float = 0.5,
             ring_latency: float = H100_RING_LATENCY,
             attn_half_tokens: float = H100_ATTN_HALF_TOKENS) -> DynamicCPCost:
        """H100/H200-class planning constants for a Qwen3-30B-A3B-shaped MoE (48 layers, 32 query
        / 4 KV heads of 128, 3.3B active params per token, bf16).

        400 TFLOP/s achieved: 989 TFLOP/s dense bf16 peak (H100 SXM datasheet) at ~40% MFU, what
        large MoE runs report; used for attention on long tiles too. 200 GB/s: NVLink 4 is 450
        GB/s per direction per GPU, NCCL send/recv reaches about half; a run of <= 8 aligned
        ranks stays inside one 8-GPU node when ranks are numbered node-major. For runs that cross
        nodes pass the InfiniBand figures, ~25-50 GB/s per GPU (NDR 400 Gb/s) and
        H100_IB_RING_LATENCY. overlap 0.5: the ring hides a transfer behind the attention of the
        block before it, almost fully for long sequences, barely for short. ring_latency and
        attn_half_tokens: see H100_RING_LATENCY and H100_ATTN_HALF_TOKENS.
        """
        return cls.from_model(num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                              active_params_per_token=3.3e9, flops_per_s=400e12,
                              bandwidth=bandwidth, overlap=overlap, ring_latency=ring_latency,
                              attn_half_tokens=attn_half_tokens)


def _kv_bytes_per_token(kv_heads: int, qk_v: int, itemsize: int, layers: int) -> float:
    """Ring bytes per token, all layers: K (q/k size) | V (v size) per KV head, travelling as
    one block forward and again backward with its dK | dV (cp_attention/ring.py)."""
    return 3.0 * kv_heads * qk_v * itemsize * layers


def _q_bytes_per_token(heads: int, qk_v: int, itemsize: int, layers: int) -> float:
    """All-to-all bytes per token of the query-sized tensors, all layers: Q and dQ have the q/k
    size, out and dout the v size (cp_attention/ulysses.py)."""
    return 2.0 * heads * qk_v * itemsize * layers


def fit_attention_efficiency(lengths: Sequence[float],
                             flops_per_s: Sequence[float]) -> tuple[float, float]:
    """(long-tile FLOP/s, n_half) of eff(L) = L / (L + n_half) fitted to attention throughputs
    measured at tile lengths L: 1/T = 1/T_max + (n_half / T_max) * (1/L) is linear in 1/L, so
    this is a least-squares line through (1/L, 1/T). Raises unless the fit gives T_max > 0 and
    n_half >= 0 (throughput that falls with length has no half-performance length)."""
    x = 1.0 / np.asarray(lengths, dtype=np.float64)
    y = 1.0 / np.asarray(flops_per_s, dtype=np.float64)
    if x.size < 2 or x.shape != y.shape:
        raise ValueError("fit_attention_efficiency: need two or more (length, FLOP/s) pairs")
    slope, intercept = np.polyfit(x, y, 1)
    if not intercept > 0 or slope < 0:
        raise ValueError(f"fit_attention_efficiency: throughputs {list(flops_per_s)} at lengths "
                         f"{list(lengths)} do not rise towards a limit (1/T = {intercept:.3g} + "
                         f"{slope:.3g}/L); measure longer tiles or on a quieter machine")
    return float(1.0 / intercept), float(slope / intercept)
