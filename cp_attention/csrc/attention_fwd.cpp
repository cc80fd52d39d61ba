// Causal attention forward for the documents of a packed row on x86 CPUs with AVX512-BF16 or AMX
// (bf16 in, fp32 accumulate): FlashAttention-2's forward with every product on cpublas::brgemm.
//
// Why: aten's CPU flash forward reaches ~80 GFLOP/s on one core of an AVX512-BF16 machine, while
// torch's exported brgemm (oneDNN's avx512_core_bf16 micro-kernel there, AMX where present) runs a
// 64x64x64 bf16 tile at ~480. Per (query block m, key block n <= m) of one head:
//
//   S = Q_m K_n^T                      (brgemm, fp32; B = K_n^T packed once per document)
//   m_new = max(m, rowmax(S) scale)    (online softmax in fp32)
//   P = exp(S scale - m_new)           (bf16 for the next product, as aten and FlashAttention do)
//   l = l exp(m - m_new) + rowsum(P),  O = O exp(m - m_new) + P V_n   (brgemm into fp32)
//
// and at the end out = O / l (bf16), lse = m + log(l): the natural-log logsumexp of the scaled
// scores, the convention of aten's kernel, so aten's backward and ours consume it unchanged.
//
// Entry point: varlen_causal_forward (at the end). Tiles are 64 x 64 (a query block never
// straddles a document: blocks start at the document's first token). Work items are
// (document, KV head, query block), longest first from a shared counter; the G query heads of one
// KV head run in one item and share its packed K/V. Every item writes only its own rows, so a
// document's result does not depend on its neighbours or on the thread count.

#include "common.h"
#include "kernels.h"

#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <memory>

namespace longctx {
namespace {

using Vec = at::vec::Vectorized<float>;
namespace cpublas = at::native::cpublas;

constexpr int64_t kBlock = 64;  // queries per query block = keys per key block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Views {  // the packed row in the caller's layouts
  const BFloat16 *q, *k, *v;  // [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
  BFloat16* out;               // [T, Hq, D]
  float* lse;                  // [Hq, T]
  BFloat16* packed;            // per document and KV head: K^T blocks, then V blocks
  int64_t T, hq, hkv, D;
  float scale;
};

inline int64_t n_blocks(int64_t len) { return (len + kBlock - 1) / kBlock; }

// Rows [r0, r0 + kBlock) of one KV head as VNNI B operands: K^T [D, 64 keys] and V [64 keys, D].
// Rows past the document are zeros: P is 0 there, but 0 * NaN from stale memory would not be.
inline void pack_block(const BFloat16* k, const BFloat16* v, int64_t ld, int64_t rows, int64_t D,
                       BFloat16* kT_out, BFloat16* v_out) {
  pack_bt(k, kT_out, D, kBlock, ld, rows);
  pack_b(v, v_out, kBlock, D, ld, rows);
}

void pack_doc_kv_head(const Views& x, const Doc& doc, int64_t hk) {
  const int64_t nb = n_blocks(doc.len), blk = kBlock * x.D, ld = x.hkv * x.D;
  BFloat16* base = x.packed + doc.packed + hk * 2 * nb * blk;
  for (int64_t n = 0; n < nb; ++n) {
    const int64_t r0 = n * kBlock, off = ((doc.start + r0) * x.hkv + hk) * x.D;
    pack_block(x.k + off, x.v + off, ld, std::min(kBlock, doc.len - r0), x.D, base + n * blk,
               base + (nb + n) * blk);
  }
}

// One key block's softmax update for `rows` query rows: S (row stride kBlock) becomes P in bf16;
// row_max / row_sum / O are updated in place. `diag`: the key block is the query block itself, so
// row i sees columns 0..i only. Written with AVX512 intrinsics and one vectorised exp for the 64
// rescale factors: this loop, not the two products, was half the kernel's time with per-row
// scalar exp and at::vec's generic horizontal reductions.
void softmax_block(float* S, BFloat16* P, float* row_max, float* row_sum, float* O, int64_t rows,
                   int64_t D, float scale, bool diag) {
  static_assert(kBlock == 64, "four vectors of 16 per row");
  alignas(64) float m_new[kBlock], alpha[kBlock];
  for (int64_t i = 0; i < rows; ++i) {
    float* s = S + i * kBlock;
    if (diag) std::fill(s + i + 1, s + kBlock, kNegInf);
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16)),
                                    _mm512_max_ps(_mm512_loadu_ps(s + 32), _mm512_loadu_ps(s + 48)));
    m_new[i] = std::max(row_max[i], _mm512_reduce_max_ps(mx) * scale);  // scale > 0
  }
  // alpha = exp(m_old - m_new): 0 on the first block (m_old = -inf, where O and row_sum are 0),
  // exactly 1 where the maximum did not move (exp_u20(0) == 1), so O is rescaled only when needed.
  for (int64_t i = 0; i < rows; i += 16) {
    const __m512 d = _mm512_sub_ps(load16(row_max + i, rows - i), load16(m_new + i, rows - i));
    _mm512_store_ps(alpha + i, Vec(d).exp_u20());
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < rows; ++i) {
    const float* s = S + i * kBlock;
    auto* p = reinterpret_cast<__m256i*>(P + i * kBlock);
    const __m512 vm = _mm512_set1_ps(-m_new[i]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < kBlock; j += 16) {
      const __m512 e = Vec(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vs, vm)).exp_u20();  // exp(-inf) = 0
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(p + j / 16, bf16x16(e));
    }
    row_sum[i] = row_sum[i] * alpha[i] + _mm512_reduce_add_ps(sum);
    row_max[i] = m_new[i];
    if (alpha[i] != 1.f) {
      float* o = O + i * D;
      const __m512 va = _mm512_set1_ps(alpha[i]);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), va));
    }
  }
}

// O[rows, D] += P[rows, 64] V_n, one brgemm per 64-column panel of V.
inline void pv_gemm(int64_t rows, int64_t D, const BFloat16* P, const BFloat16* v_blk, float* O) {
  for (int64_t c0 = 0; c0 < D; c0 += kPanel) {
    const int64_t w = std::min(kPanel, D - c0);
    cpublas::brgemm(rows, w, kBlock, kBlock, w, D, true, P, v_blk + c0 * kBlock, O + c0);
  }
}

struct Scratch {  // one thread's buffers; O and the row statistics for each of the G heads
  std::vector<float> S, O, row_max, row_sum;
  std::vector<BFloat16> P;
  Scratch(int64_t G, int64_t D)
      : S(kBlock * kBlock), O(G * kBlock * D), row_max(G * kBlock), row_sum(G * kBlock),
        P(kBlock * kBlock) {}
};

// Query block m of document `doc` for every query head of KV head hk. Key blocks are the outer
// loop so that each packed K/V tile, streamed from L3 for long documents, serves all G heads
// while it is in L1/L2 (head-outer measured ~1.3x slower on 8192 tokens, G = 2).
void forward_item(const Views& x, const Doc& doc, int64_t hk, int64_t m, Scratch& w) {
  const int64_t D = x.D, G = x.hq / x.hkv, nb = n_blocks(doc.len), blk = kBlock * D;
  const int64_t q0 = doc.start + m * kBlock, rows = std::min(kBlock, doc.len - m * kBlock);
  const BFloat16* kT = x.packed + doc.packed + hk * 2 * nb * blk;
  const BFloat16* vp = kT + nb * blk;
  std::fill(w.O.begin(), w.O.end(), 0.f);
  std::fill(w.row_max.begin(), w.row_max.end(), kNegInf);
  std::fill(w.row_sum.begin(), w.row_sum.end(), 0.f);
  for (int64_t n = 0; n <= m; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const BFloat16* q = x.q + (q0 * x.hq + hk * G + g) * D;  // this head's rows: stride Hq * D
      float* O = w.O.data() + g * kBlock * D;
      cpublas::brgemm(rows, kBlock, D, x.hq * D, kBlock, kBlock, false, q, kT + n * blk, w.S.data());
      softmax_block(w.S.data(), w.P.data(), w.row_max.data() + g * kBlock,
                    w.row_sum.data() + g * kBlock, O, rows, D, x.scale, n == m);
      pv_gemm(rows, D, w.P.data(), vp + n * blk, O);
    }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hk * G + g;
    for (int64_t i = 0; i < rows; ++i) {
      const float sum = w.row_sum[g * kBlock + i], inv = 1.f / sum;  // >= 1: a row sees its own key
      float* o = w.O.data() + (g * kBlock + i) * D;
      for (int64_t d = 0; d < D; d += Vec::size()) (Vec::loadu(o + d) * Vec(inv)).store(o + d);
      to_bf16(o, x.out + ((q0 + i) * x.hq + h) * D, D);
      x.lse[h * x.T + q0 + i] = w.row_max[g * kBlock + i] + std::log(sum);
    }
  }
}

}  // namespace

// Causal self-attention over the documents of a packed row: q [T, Hq, D], k, v [T, Hkv, D] (bf16,
// contiguous), cu_seqlens [N + 1] int64 (document i is rows [cu[i], cu[i+1]) of q, k and v).
// Returns out [T, Hq, D] bf16 and lse [Hq, T] fp32; rows outside every document get 0 and -inf.
std::vector<at::Tensor> varlen_causal_forward(at::Tensor q, at::Tensor k, at::Tensor v,
                                              at::Tensor cu_seqlens, double scale) {
  for (const auto& t : {q, k, v})
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 3,
                "cpu attention forward: contiguous bf16 [T, H, D] tensors expected");
  const int64_t T = q.size(0), hq = q.size(1), hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D && hq % hkv == 0 &&
              D % 16 == 0 && D <= 256 && scale > 0,
              "cpu attention forward: head dim a multiple of 16 up to 256, Hq % Hkv == 0, scale > 0");
  std::vector<Doc> docs = documents(cu_seqlens, T, "cpu attention forward");
  int64_t packed = 0;
  for (auto& doc : docs) {
    doc.packed = packed;
    packed += 2 * hkv * n_blocks(doc.len) * kBlock * D;
  }
  auto out = at::zeros_like(q);
  auto lse = at::full({hq, T}, kNegInf, q.options().dtype(at::kFloat));
  auto buf = at::empty({packed}, q.options());
  Views x{q.const_data_ptr<BFloat16>(), k.const_data_ptr<BFloat16>(), v.const_data_ptr<BFloat16>(),
          out.data_ptr<BFloat16>(), lse.data_ptr<float>(), buf.data_ptr<BFloat16>(),
          T, hq, hkv, D, static_cast<float>(scale)};
  longest_first(docs);
  const int64_t nd = static_cast<int64_t>(docs.size());
  run_items(nd * hkv, [&](int64_t i) { pack_doc_kv_head(x, docs[i / hkv], i % hkv); });
  // (document, KV head, query block); block m costs m + 1 tile pairs per head.
  struct Item {
    int32_t doc, hk, m;
  };
  std::vector<Item> items;
  for (int64_t d = 0; d < nd; ++d)
    for (int64_t m = 0; m < n_blocks(docs[d].len); ++m)
      for (int64_t h = 0; h < hkv; ++h) items.push_back({int32_t(d), int32_t(h), int32_t(m)});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.m > b.m; });
  std::vector<std::unique_ptr<Scratch>> scratch(at::get_num_threads());
  run_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
    auto& w = scratch[at::get_thread_num()];
    if (!w) w = std::make_unique<Scratch>(hq / hkv, D);
    forward_item(x, docs[items[i].doc], items[i].hk, items[i].m, *w);
  });
  return {out, lse};
}

}  // namespace longctx
