// What every kernel of this extension shares (x86-64 with AVX512-BF16; built with the flags in
// cp_attention/native.py, so the AVX512 intrinsics below are always compiled in): bf16 <-> float32
// conversions with masked loads and stores, the VNNI packing of brgemm's B operands, the
// documents of a packed row, and the longest-first work loop of the attention kernels.
//
// Every bf16 rounding here is round-to-nearest-even (_mm512_cvtneps_pbh), the rounding of aten's
// bf16 conversion, so a kernel that rounds where the torch path stores a bf16 tensor gets its bits.
#pragma once

// The parts of ATen the kernels use, not <ATen/ATen.h> (every operator): a third of the headers'
// compile time, paid once per .cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace longctx {

using at::BFloat16;

// The first n of 16 lanes (all 16 for n >= 16): the mask of a row's vector tail.
inline __mmask16 head(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// 16 bf16 values (in a 256-bit register) as float32: exact, a bf16 is a float32's upper half.
inline __m512 widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// 16 float32 values rounded to bf16 (nearest even), in a 256-bit register.
inline __m256i bf16x16(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return reinterpret_cast<const __m256i&>(b);
}

// 16 values (or the first n, the rest zero) as float32.
inline __m512 load16(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(head(n), p); }
inline __m512 load16(const BFloat16* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(head(n), p)); }

// Store the first n of 16 float32 values (to bf16: rounded to nearest even).
inline void store16(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, head(n), v); }
inline void store16(BFloat16* p, __m512 v, int64_t n) { _mm256_mask_storeu_epi16(p, head(n), bf16x16(v)); }

// A float32 row to bf16, 16 values a step, the tail through c10's conversion (the same rounding).
inline void to_bf16(const float* src, BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bf16x16(_mm512_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = static_cast<BFloat16>(src[i]);
}

// brgemm's B operands in the VNNI layout (pairs of K rows interleaved: element (k, n) at
// ((k / 2) * w + n) * 2 + k % 2 for a panel w columns wide; K even). A [K, N] operand is stored as
// panels of at most kPanel columns (panel p, K x w, at offset p * kPanel * K), one brgemm each. 64
// is the widest panel oneDNN's own packer accepted when tried; these packers replace it (it builds
// a oneDNN transform object on every call) but keep its layout, so wider panels are untested.
constexpr int64_t kPanel = 64;
static_assert(sizeof(BFloat16) == 2, "VNNI packing moves bf16 pairs as 32-bit words");

// The B operand [K, N] of row-major rows in[k, :] (row stride ld_in); rows from `rows` on read as
// zero (a tile past the end of a document: 0 * NaN from stale memory would not be 0).
inline void pack_b(const BFloat16* in, BFloat16* out, int64_t K, int64_t N, int64_t ld_in, int64_t rows) {
  const auto* src = reinterpret_cast<const uint16_t*>(in);
  auto* dst = reinterpret_cast<uint16_t*>(out);
  for (int64_t n0 = 0; n0 < N; n0 += kPanel) {
    const int64_t w = std::min(kPanel, N - n0);
    uint16_t* panel = dst + n0 * K;
    for (int64_t k = 0; k < K; k += 2) {
      const uint16_t* r0 = src + k * ld_in + n0;
      const uint16_t* r1 = r0 + ld_in;
      uint16_t* o = panel + k * w;
      if (k + 1 < rows) {
        for (int64_t n = 0; n < w; ++n) {
          o[2 * n] = r0[n];
          o[2 * n + 1] = r1[n];
        }
      } else {
        for (int64_t n = 0; n < w; ++n) {
          o[2 * n] = k < rows ? r0[n] : 0;
          o[2 * n + 1] = 0;
        }
      }
    }
  }
}

// The B operand [K, N] (N <= kPanel: one panel) of the transpose of row-major rows in[n, :] (row
// stride ld_in): the pair (k, k + 1) is adjacent in a source row, so this is a 32-bit transpose
// with contiguous reads. Rows from `rows` on read as zero, as in pack_b.
inline void pack_bt(const BFloat16* in, BFloat16* out, int64_t K, int64_t N, int64_t ld_in, int64_t rows) {
  const auto* src = reinterpret_cast<const uint32_t*>(in);
  auto* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t p = 0; p < K / 2; ++p) dst[p * N + n] = n < rows ? src[n * (ld_in / 2) + p] : 0u;
}

// One document of a packed row: rows [start, start + len); `packed` is where the attention
// forward keeps its packed K/V (unused by the backward).
struct Doc {
  int64_t start, len, packed;
};

// The non-empty documents of cu_seqlens [N + 1] (int64, document i is rows [cu[i], cu[i+1]) of a
// row of T tokens), in order.
inline std::vector<Doc> documents(const at::Tensor& cu_seqlens, int64_t T, const char* who) {
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1, who, ": int64 cu_seqlens");
  auto cu = cu_seqlens.accessor<int64_t, 1>();
  TORCH_CHECK(cu.size(0) >= 1 && cu[cu.size(0) - 1] <= T, who, ": boundaries past T");
  std::vector<Doc> docs;
  for (int64_t i = 0; i + 1 < cu.size(0); ++i)
    if (cu[i + 1] > cu[i]) docs.push_back({cu[i], cu[i + 1] - cu[i], 0});
  return docs;
}

inline void longest_first(std::vector<Doc>& docs) {
  std::sort(docs.begin(), docs.end(), [](const Doc& a, const Doc& b) { return a.len > b.len; });
}

// Runs fn(i) for i in [0, n) on torch's threads, taking items from a shared counter in the given
// order: with the items sorted longest first this is a greedy longest-first schedule (a static
// split of sorted items would give one thread all the long ones). Every item writes only its own
// rows, so a result depends neither on the thread count nor on which thread ran it.
template <typename F>
void run_items(int64_t n, F fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
    at::native::cpublas::brgemm_release();  // frees the AMX tile state; nothing to free on AVX512-BF16
  });
}

}  // namespace longctx
