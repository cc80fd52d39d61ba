// Causal attention backward for one document per head on x86 CPUs with AMX or AVX512-BF16 (bf16 in,
// fp32 accumulate).
//
// Why: aten's CPU flash backward accumulates dQ/dK/dV into bf16 outputs tile by tile through
// generic GEMM calls; on a 2048-token document it costs ~5x its forward. This kernel runs every
// product through cpublas::brgemm (oneDNN's AMX micro-kernel, or its avx512_core_bf16 one on CPUs
// without AMX) with fp32 accumulators, in the transposed ("key-major") form of FlashAttention-2's
// backward so that every A operand is a row-major tile we already hold and every B operand is
// packed once per head:
//
//   S^T  = K_n Q_m^T          P^T = exp(scale S^T - lse_m), 0 where key > query
//   dP^T = V_n dO_m^T         dS^T = P^T (dP^T - delta_m) scale
//   dQ_m^T += K_n^T dS^T      (per tile)
//   dV_n += P^T dO,  dK_n += dS^T Q   (per key block, over kChunk queries at once)
//
// Entry point: varlen_causal_backward (at the end), over every document of a packed row.
// Tiles of Bk keys x Bq queries (64 x 64 as amx_backward.py calls it); every (document, KV head)
// pair is one parallel work item. Every B operand is packed by hand (common.h's pack_b, pack_bt),
// so nothing depends on cpublas::could_pack, which is False without AMX.

#include "common.h"
#include "kernels.h"

#include <ATen/cpu/vec/vec.h>

#include <limits>

namespace longctx {
namespace {

using Vec = at::vec::Vectorized<float>;
namespace cpublas = at::native::cpublas;

inline void store_bf16(const Vec& v, BFloat16* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bf16x16(v));
}

// Queries per dV / dK product: P^T and dS^T of one key block are kept for this many queries, so the
// product's A operand (2 x 64 KiB) is still in L2 when it runs. Over a whole 8192-token document
// (2 MiB of A, streamed back from L3) the kernel measured 5-7% slower; 256 and 1024 measured as 512.
constexpr int64_t kChunk = 512;

// dst[c, r] = src[r, c] for a [R, C] block, in 64-row strips so that neither side strides by a
// whole row of the other (rows here are 4 KiB apart: every column would hit one cache set).
template <typename S, typename T>
inline void transpose(const S* src, T* dst, int64_t R, int64_t C, int64_t ld_src, int64_t ld_dst) {
  for (int64_t r0 = 0; r0 < R; r0 += 64)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = r0; r < std::min(R, r0 + 64); ++r) dst[c * ld_dst + r] = static_cast<T>(src[r * ld_src + c]);
}

// C[M, N] (+)= A[M, K] (row stride lda) @ rows [k0, k0 + K) of a B packed by pack_b with
// K_total rows (default: exactly these K).
inline void gemm(int64_t M, int64_t N, int64_t K, const BFloat16* A, int64_t lda, const BFloat16* B,
                 float* C, int64_t ldc, bool add, int64_t K_total = -1, int64_t k0 = 0) {
  if (K_total < 0) K_total = K;
  for (int64_t n0 = 0; n0 < N; n0 += kPanel) {
    const int64_t w = std::min(kPanel, N - n0);
    cpublas::brgemm(M, w, K, lda, w, ldc, add, A, B + n0 * K_total + k0 * w, C + n0);
  }
}

struct Views {  // the packed row in the caller's [T, H, D] layouts
  const BFloat16 *q, *dout, *out, *k, *v;
  const float* lse;  // [Hq, T]
  BFloat16 *dq, *dk, *dv;
  int64_t T, hq, hkv, D, Bq, Bk;
  float scale;
};

void gather_rows(const BFloat16* src, int64_t heads, int64_t h, const Doc& doc, int64_t D,
                 int64_t Lp, BFloat16* dst) {
  for (int64_t i = 0; i < doc.len; ++i)
    std::copy_n(src + ((doc.start + i) * heads + h) * D, D, dst + i * D);
  std::fill(dst + doc.len * D, dst + Lp * D, BFloat16(0.f));
}

void scatter_rows(const float* src, int64_t heads, int64_t h, const Doc& doc, int64_t D,
                  BFloat16* dst) {
  for (int64_t i = 0; i < doc.len; ++i) to_bf16(src + i * D, dst + ((doc.start + i) * heads + h) * D, D);
}

// One (document, KV head): the G query heads sharing it, on contiguous copies of the document's
// rows zero-padded to a multiple of Bk (padded queries get lse = +inf, so P = 0 there, and a
// padded key is later than every real query, so causality hides it).
void backward_doc_kv_head(const Views& x, const Doc& doc, int64_t hk) {
  // Tiles of Bk keys x Bq queries: Q^T and dO^T are packed per query block, one panel each, so
  // Bq <= 64 (the panel width).
  const int64_t D = x.D, Bq = x.Bq, Bk = x.Bk, groups = x.hq / x.hkv;
  const int64_t L = (doc.len + Bk - 1) / Bk * Bk, nq = L / Bq, nk = L / Bk;
  const float scale = x.scale;
  std::vector<BFloat16> k_h(L * D), v_h(L * D), kT(D * L);
  gather_rows(x.k, x.hkv, hk, doc, D, L, k_h.data());
  gather_rows(x.v, x.hkv, hk, doc, D, L, v_h.data());
  transpose(k_h.data(), kT.data(), L, D, D, L);  // K^T [D, L]: the A operand of dQ^T += K_n^T dS^T
  std::vector<float> dk_acc(L * D, 0.f), dv_acc(L * D, 0.f);
  // Per query head: Q^T, dO^T blocks packed as B [D, Bq]; Q, dO packed whole as B [L, D].
  std::vector<BFloat16> q_h(L * D), do_h(L * D), o_h(L * D);
  std::vector<BFloat16> qT_pk(D * L), doT_pk(D * L), q_pk(L * D), do_pk(L * D);
  // dQ^T accumulators blocked per query block ([nq][D][Bq]): each tile's 16 KiB accumulator is
  // contiguous. As one [D, L] array its 64 rows lie a whole row of L floats apart, and loading it
  // from L3 for every tile cost ~3% of the kernel on an 8192-token document.
  std::vector<float> lse_h(L), delta(L), dqT_acc(D * L), dq_rows(L * D);
  std::vector<float> sT(Bk * Bq), dpT(Bk * Bq);
  // P^T and dS^T of one key block against up to kChunk queries, so that dV_n and dK_n are one
  // product each per chunk (one accumulator load/store per chunk, not one per tile).
  static_assert(kChunk % 64 == 0, "a chunk holds whole query blocks");
  std::vector<BFloat16> pT_row(Bk * kChunk), dsT_row(Bk * kChunk), dsT_pk(Bk * Bq);

  for (int64_t g = 0; g < groups; ++g) {
    const int64_t h = hk * groups + g;
    gather_rows(x.q, x.hq, h, doc, D, L, q_h.data());
    gather_rows(x.dout, x.hq, h, doc, D, L, do_h.data());
    gather_rows(x.out, x.hq, h, doc, D, L, o_h.data());
    std::copy_n(x.lse + h * x.T + doc.start, doc.len, lse_h.data());
    std::fill(lse_h.begin() + doc.len, lse_h.end(), std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < L; ++i) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d)
        acc += static_cast<float>(do_h[i * D + d]) * static_cast<float>(o_h[i * D + d]);
      delta[i] = acc;
    }
    for (int64_t m = 0; m < nq; ++m) {
      pack_bt(q_h.data() + m * Bq * D, qT_pk.data() + m * D * Bq, D, Bq, D, Bq);
      pack_bt(do_h.data() + m * Bq * D, doT_pk.data() + m * D * Bq, D, Bq, D, Bq);
    }
    pack_b(q_h.data(), q_pk.data(), L, D, D, L);
    pack_b(do_h.data(), do_pk.data(), L, D, D, L);
    std::fill(dqT_acc.begin(), dqT_acc.end(), 0.f);

    for (int64_t n = 0; n < nk; ++n) {
      const int64_t n0 = n * Bk;
      const int64_t q0 = n0 / Bq * Bq;  // causal: queries from the key block on
      for (int64_t m = q0 / Bq; m < nq; ++m) {
        const int64_t m0 = m * Bq;
        const int64_t cs = q0 + (m0 - q0) / kChunk * kChunk;  // this tile's chunk: queries [cs, cs + cw)
        const int64_t cw = std::min(kChunk, L - cs);
        BFloat16* pT16 = pT_row.data() + (m0 - cs);  // this tile's columns, row stride cw
        BFloat16* dsT16 = dsT_row.data() + (m0 - cs);
        const float* lse_m = lse_h.data() + m0;
        const float* delta_m = delta.data() + m0;
        // S^T = K_n Q_m^T  [Bk keys, Bq queries]
        gemm(Bk, Bq, D, k_h.data() + n0 * D, D, qT_pk.data() + m * D * Bq, sT.data(), Bq, false);
        for (int64_t i = 0; i < Bk; ++i) {
          float* row = sT.data() + i * Bq;
          // query m0 + j sees key n0 + i iff j >= n0 + i - m0
          const int64_t j0 = std::min<int64_t>(Bq, std::max<int64_t>(0, n0 + i - m0));
          BFloat16* p16 = pT16 + i * cw;
          std::fill(row, row + j0, 0.f);
          std::fill(p16, p16 + j0, BFloat16(0.f));
          int64_t j = j0;
          for (; j + Vec::size() <= Bq; j += Vec::size()) {
            // as the forward: error far below P's bf16 rounding, ~7% faster
            const Vec e = (Vec::loadu(row + j) * Vec(scale) - Vec::loadu(lse_m + j)).exp_u20();
            e.store(row + j);  // P in fp32 for dS, and in bf16 for dV
            store_bf16(e, p16 + j);
          }
          for (; j < Bq; ++j) {
            row[j] = std::exp(row[j] * scale - lse_m[j]);
            p16[j] = static_cast<BFloat16>(row[j]);
          }
        }
        // dP^T = V_n dO_m^T
        gemm(Bk, Bq, D, v_h.data() + n0 * D, D, doT_pk.data() + m * D * Bq, dpT.data(), Bq, false);
        // dS^T only in bf16 (no product reads it in fp32), written twice: as rows (the A operand of
        // dK_n) and as the VNNI B operand of dQ^T (pack_b's layout, one panel as Bq <= 64: the
        // pair of keys (i, i + 1) of query j is the 32-bit word (i / 2) Bq + j), two rows at a time.
        auto* dsT_words = reinterpret_cast<int32_t*>(dsT_pk.data());
        for (int64_t i = 0; i < Bk; i += 2) {
          for (int64_t j = 0; j < Bq; j += Vec::size()) {  // Bq is a multiple of 16
            __m256i ds[2];
            for (int64_t r = 0; r < 2; ++r) {
              const float* p = sT.data() + (i + r) * Bq + j;
              const float* dp = dpT.data() + (i + r) * Bq + j;
              ds[r] = bf16x16(Vec::loadu(p) * (Vec::loadu(dp) - Vec::loadu(delta_m + j)) * Vec(scale));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsT16 + (i + r) * cw + j), ds[r]);
            }
            const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32(ds[0]),
                                                  _mm512_slli_epi32(_mm512_cvtepu16_epi32(ds[1]), 16));
            _mm512_storeu_si512(dsT_words + (i / 2) * Bq + j, pairs);
          }
        }
        // dQ_m^T += K_n^T dS^T  (A = K^T[:, n0:n0+Bk], lda L; B = dS^T packed [Bk keys, Bq queries];
        // C = block m of dQ^T)
        gemm(D, Bq, Bk, kT.data() + n0, L, dsT_pk.data(), dqT_acc.data() + m * D * Bq, Bq, true);
        if (m0 + Bq == cs + cw) {  // the chunk is complete: dV_n += P^T dO[cs:cs+cw], dK_n += dS^T Q[cs:cs+cw]
          gemm(Bk, D, cw, pT_row.data(), cw, do_pk.data(), dv_acc.data() + n0 * D, D, true, L, cs);
          gemm(Bk, D, cw, dsT_row.data(), cw, q_pk.data(), dk_acc.data() + n0 * D, D, true, L, cs);
        }
      }
    }
    for (int64_t m = 0; m < nq; ++m)
      transpose(dqT_acc.data() + m * D * Bq, dq_rows.data() + m * Bq * D, D, Bq, Bq, D);
    scatter_rows(dq_rows.data(), x.hq, h, doc, D, x.dq);
  }
  scatter_rows(dk_acc.data(), x.hkv, hk, doc, D, x.dk);
  scatter_rows(dv_acc.data(), x.hkv, hk, doc, D, x.dv);
}

}  // namespace

// Backward of causal self-attention over the documents of a packed row: q, dout, out [T, Hq, D],
// k, v [T, Hkv, D] (bf16, contiguous), lse [Hq, T] fp32, cu_seqlens [N + 1] int64 (documents are
// [cu[i], cu[i+1]), each attending to itself only). Returns dq, dk, dv in the input layouts.
std::vector<at::Tensor> varlen_causal_backward(at::Tensor dout, at::Tensor q, at::Tensor k,
                                               at::Tensor v, at::Tensor out, at::Tensor lse,
                                               at::Tensor cu_seqlens, double scale, int64_t block_q,
                                               int64_t block_k) {
  for (const auto& t : {dout, q, k, v, out})
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 3,
                "amx attention backward: contiguous bf16 [T, H, D] tensors expected");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "amx attention backward: fp32 lse");
  Views x{q.const_data_ptr<BFloat16>(), dout.const_data_ptr<BFloat16>(), out.const_data_ptr<BFloat16>(),
          k.const_data_ptr<BFloat16>(), v.const_data_ptr<BFloat16>(), lse.const_data_ptr<float>(),
          nullptr, nullptr, nullptr, q.size(0), q.size(1), k.size(1), q.size(2), block_q, block_k,
          static_cast<float>(scale)};
  TORCH_CHECK(x.D % 16 == 0 && x.hq % x.hkv == 0 && block_q % 16 == 0 && block_q <= 64 &&
              kChunk % block_q == 0 && block_k % block_q == 0,
              "amx attention backward: head dim and query block must be multiples of 16, query "
              "block 16, 32 or 64, key block a multiple of it");
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  x.dq = dq.data_ptr<BFloat16>();
  x.dk = dk.data_ptr<BFloat16>();
  x.dv = dv.data_ptr<BFloat16>();
  std::vector<Doc> docs = documents(cu_seqlens, x.T, "amx attention backward");
  // Work items (document, KV head), longest first.
  longest_first(docs);
  run_items(static_cast<int64_t>(docs.size()) * x.hkv,
            [&](int64_t w) { backward_doc_kv_head(x, docs[w / x.hkv], w % x.hkv); });
  return {dq, dk, dv};
}

}  // namespace longctx
