"""Group the documents of a packed row into padded batches ("buckets") for a batched dense kernel.

Pure host-side planning, cached per (boundaries, causal): the model calls attention with the same
cu_seqlens in every layer, forward and backward, so planning costs once per micro-batch.

Two layouts, both exact:
- "shift" (causal): document b is laid out in P = max Lk slots; key j sits at slot j and query i at
  slot i + Lk_b - Lq_b. The kernel's top-left causal mask on the square P x P then equals the
  bottom-right causal mask of the document, and no real query ever sees a padded key, so no mask
  tensor is needed. Queries with a negative slot see no key: they are left out (lse -inf, out 0).
- "masked": query i at slot i, key j at slot j, plus a boolean mask [B, 1, Pq or 1, Pk] for key
  padding (and the bottom-right causal mask when a causal document has Lq much smaller than Lk,
  where the square "shift" layout would waste work).

Padded slots gather a real token (finite values) and are never scattered back; in the backward
they get dout = 0 and lse = +inf, so they contribute exactly zero.
Shape legend: B documents in a bucket, Pq / Pk padded query / key slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

# Fixed cost of one kernel call (gather, launch, scatter) in causal score elements per head:
# a tiny call costs ~0.3 ms of one core here, the time of a few thousand score elements in
# fwd+bwd. Buckets merge while their padding costs less. A performance knob only, never a
# correctness matter.
CALL_OVERHEAD = 8192
# Padding a causal bucket of length in [pad_to - PAD_WINDOW, pad_to) up to pad_to (see torch_cpu:
# the CPU kernel switches to 4x larger, far cheaper query blocks from 768 rows on).
PAD_WINDOW = 168
_DP_LIMIT = 160  # beyond this many documents, bucket greedily instead of the O(N^2) DP


# Batch invariance (`invariant` of plan_buckets; AttnKernel.batch_invariant): every document in a
# bucket of its own, so that its output does not depend on the documents packed beside it.
# Why: aten's CPU flash kernel gives a row a result that depends on the padded length P of its
# bucket (different block splits of the same reduction): a 300-token document in a bucket padded
# to 320 differs by up to 1e-3 in bf16 from the same document alone, and a log-prob by up to 7e-2
# (bench/batch_invariance.py). Per-document buckets make P a function of the document's own
# length. The cost is one kernel call per document (~0.3 ms each on a CPU core), negligible beside
# long sequences; RL log-prob and training passes use it so that the same sequence gets bitwise
# the same log-probs whatever its neighbours. The expert GEMMs follow the same choice
# (longctx_moe.model.grouped_gemm.wants_padding).


@dataclass
class Bucket:
    layout: str  # "shift" (kernel is_causal, no mask tensor) or "masked"
    batch: int
    pq: int
    pk: int
    q_src: torch.Tensor  # long [B*Pq]: token gathered into each query slot (valid for padding)
    k_src: torch.Tensor  # long [B*Pk]
    q_pos: torch.Tensor  # long [Mq]: slots holding real queries that see at least one key
    q_tok: torch.Tensor  # long [Mq]: their token indices
    k_pos: torch.Tensor  # long [Mk]: slots holding real keys
    k_tok: torch.Tensor  # long [Mk]
    q_pad: torch.Tensor  # bool [B*Pq]: True at slots that are not in q_pos
    mask: torch.Tensor | None  # bool [B, 1, Pq or 1, Pk]: True = may attend; None = no mask
    q_slice: int | None = None  # in-place bucket (one document read through views): its start
    k_slice: int | None = None
    q_len: int = 0  # in-place bucket: its real query / key count (slots past it are padding)
    k_len: int = 0
    _additive: dict = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype, device) -> torch.Tensor | None:
        """The mask as the kernel wants it: 0 / -inf in the query dtype, cached per dtype."""
        if self.mask is None:
            return None
        key = (dtype, str(device))
        if key not in self._additive:
            m = torch.zeros(self.mask.shape, dtype=dtype, device=device)
            self._additive[key] = m.masked_fill_(~self.mask.to(device), float("-inf"))
        return self._additive[key]


def _layout(causal: bool, lq: int, lk: int, window: int | None = None, offset: int = 0) -> str:
    # The square shift layout costs Lk^2/2; the masked one Lq*Lk. Prefer no mask unless it wastes.
    # A sliding window or an offset alignment needs a mask tensor: always the masked layout.
    return "shift" if causal and 2 * lq >= lk and window is None and not offset else "masked"


def _area(layout: str, pq: int, pk: int) -> int:
    return pk * pk // 2 if layout == "shift" else pq * pk


def _partition(docs: list[tuple[int, int, int]], layout: str) -> list[list[int]]:
    """Split docs (index, Lq, Lk), sorted by decreasing size, into contiguous runs that minimise
    sum(CALL_OVERHEAD + B * padded area): exact DP for small N, greedy otherwise."""
    n = len(docs)
    if n > _DP_LIMIT:
        return _greedy(docs, layout)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        pq = pk = 0
        for start in range(end - 1, -1, -1):
            pq, pk = max(pq, docs[start][1]), max(pk, docs[start][2])
            cost = best[start] + CALL_OVERHEAD + (end - start) * _area(layout, pq, pk)
            if cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], n
    while end > 0:
        runs.append(list(range(cut[end], end)))
        end = cut[end]
    return runs[::-1]


def _greedy(docs, layout):
    runs, cur, pq, pk, real = [], [], 0, 0, 0
    for i, (_, lq, lk) in enumerate(docs):
        npq, npk, area = max(pq, lq), max(pk, lk), _area(layout, lq, lk)
        if cur and (len(cur) + 1) * _area(layout, npq, npk) - (real + area) > CALL_OVERHEAD:
            runs.append(cur)
            cur, npq, npk, real = [], lq, lk, 0
        cur.append(i)
        pq, pk, real = npq, npk, real + area
    return runs + ([cur] if cur else [])


def _doc_slots(layout, sq, lq, sk, lk, pq, pk, causal=False, window=None, offset=0):
    """One document's slots: (q_src [Pq], k_src [Pk], query-slot validity [Pq] bool, query
    token per slot [Pq], key validity [Pk] bool). Invalid slots gather the document's first token.
    Causal queries that see no key (bottom-right, Lq > Lk; or moved by `offset` before the first
    key or, with a window, more than `window` past the last) are invalid in either layout."""
    slot_q, slot_k = torch.arange(pq), torch.arange(pk)
    first = lk - lq if layout == "shift" else 0  # slot of query 0; negative = rows that see nothing
    tok_q = sq + slot_q - first
    valid_q = (slot_q >= max(first, 0)) & (slot_q < first + lq)
    if causal and layout == "masked":
        row = slot_q + lk - lq + offset  # the last key position each query may see
        valid_q &= row >= 0
        if window is not None:
            valid_q &= row - window < lk - 1
    valid_k = slot_k < lk
    q_src = torch.where(valid_q, tok_q, sq)
    k_src = torch.where(valid_k, sk + slot_k, sk)
    return q_src, k_src, valid_q, tok_q, valid_k


def _doc_mask(layout, causal, lq, lk, pq, pk, window=None, offset=0):
    """bool [1, Pq or 1, Pk] for the masked layout: key padding, plus bottom-right causal moved by
    `offset`, plus the sliding window on real query rows (padded rows keep keys so that no row is
    all -inf; real rows that see no key are left out by _doc_slots)."""
    key_ok = torch.arange(pk) < lk
    if not causal:
        return key_ok.view(1, 1, pk)
    rows = torch.arange(pq)[:, None] + (lk - lq + offset)
    cols = torch.arange(pk)[None, :]
    padded = torch.arange(pq)[:, None] >= lq
    ok = key_ok[None, :] & ((cols <= rows) | padded)
    if window is not None:
        ok &= (cols > rows - window) | padded
    return ok.view(1, pq, pk)


def build_bucket(layout, causal, members, starts_q, lens_q, starts_k, lens_k,
                 pad_to: int = 0, ends=(0, 0), window: int | None = None,
                 offset: int = 0) -> Bucket:
    """Stack the slots of the documents in `members` (document indices) into one Bucket.
    A "shift" bucket whose length is within PAD_WINDOW of `pad_to` is padded up to it.
    ends = (T, S): the real token counts (see _mark_in_place)."""
    lq = [lens_q[i] for i in members]
    lk = [lens_k[i] for i in members]
    pk = max(lk)
    if layout == "shift" and pad_to - PAD_WINDOW <= pk < pad_to:
        pk = pad_to
    pq = pk if layout == "shift" else max(lq)
    parts = [_doc_slots(layout, starts_q[i], lens_q[i], starts_k[i], lens_k[i], pq, pk, causal,
                        window, offset) for i in members]
    q_src, k_src, valid_q, tok_q, valid_k = (torch.cat(t) for t in zip(*parts, strict=False))
    mask = None
    if layout == "masked" and (causal or min(lk) < pk):
        mask = torch.stack([_doc_mask(layout, causal, a, b, pq, pk, window, offset)
                            for a, b in zip(lq, lk, strict=False)])
    b = Bucket(layout, len(members), pq, pk, q_src, k_src,
               q_pos=valid_q.nonzero().flatten(), q_tok=tok_q[valid_q],
               k_pos=valid_k.nonzero().flatten(), k_tok=k_src[valid_k],
               q_pad=~valid_q, mask=mask)
    if len(members) == 1:
        _mark_in_place(b, starts_q[members[0]], lq[0], starts_k[members[0]], lk[0], ends)
    return b


def _mark_in_place(b: Bucket, sq: int, lq: int, sk: int, lk: int, ends) -> None:
    """A one-document bucket whose slots are the token runs [sq, sq + Pq) and [sk, sk + Pk) is
    read through views instead of gathers. Slots past the document then hold the tokens that
    follow it (finite values, never seen by its queries; their rows are dropped), so this needs
    that many tokens to follow: sq + Pq <= T and sk + Pk <= S."""
    if b.layout == "shift" and lq != lk:  # queries would not start at slot 0
        return
    if sq + b.pq <= ends[0] and sk + b.pk <= ends[1]:
        b.q_slice, b.k_slice, b.q_len, b.k_len = sq, sk, lq, lk


@lru_cache(maxsize=64)
def plan_buckets(bounds_q: tuple, bounds_k: tuple, causal: bool, pad_to: int = 0,
                 invariant: bool = False, window: int | None = None,
                 offset: int = 0) -> tuple[Bucket, ...]:
    """Buckets covering every document with at least one query and one key (see build_bucket
    for pad_to). `invariant`: one bucket per document (see batch_invariant); `window`: a causal
    sliding window, `offset`: the causal alignment moved (both in the masked layout)."""
    starts_q, starts_k = bounds_q[:-1], bounds_k[:-1]
    lens_q = [b - a for a, b in zip(bounds_q[:-1], bounds_q[1:], strict=False)]
    lens_k = [b - a for a, b in zip(bounds_k[:-1], bounds_k[1:], strict=False)]
    by_layout: dict[str, list] = {}
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=False)):
        if lq > 0 and lk > 0:
            by_layout.setdefault(_layout(causal, lq, lk, window, offset), []).append((i, lq, lk))
    buckets = []
    for layout, docs in by_layout.items():
        docs.sort(key=lambda d: (d[2], d[1]), reverse=True)
        runs = [[j] for j in range(len(docs))] if invariant else _partition(docs, layout)
        for run in runs:
            members = [docs[j][0] for j in run]
            buckets.append(build_bucket(layout, causal, members, starts_q, lens_q, starts_k, lens_k,
                                        pad_to, (bounds_q[-1], bounds_k[-1]), window, offset))
    return tuple(buckets)
