// RMSNorm forward and backward on CPU rows, one pass over each row per direction (AVX512).
//
// For rows x [N, D] (float32 or bf16) and a float32 weight w [D], in float32:
//   forward:  r = 1 / sqrt(sum(x^2) / D + eps),  y = (x r) w      (y in float32 or bf16)
//   backward: xh = x r,  gw = g w,  dx = r (gw - xh sum(gw xh) / D)   (dx in x's dtype)
//             dw = sum over rows of g xh                               (float32)
// This is model.layers._RMSNormFn's arithmetic (the torch path computes it in ~8 elementwise
// passes over [N, D] each way, with float32 copies of bf16 inputs in between), so the two differ
// only by the order of each row's float32 sum. Rows are split over the intra-op threads by
// at::parallel_for; each thread sums its rows' share of dw in its own buffer, and the buffers are
// added in thread order, so a run is deterministic for a given thread count.

#include "common.h"
#include "kernels.h"

#include <cmath>

namespace longctx {
namespace {

template <typename TX, typename TY>
void forward_rows(const TX* x, const float* w, TY* y, float* r, int64_t N, int64_t D, float eps) {
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const TX* xi = x + i * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < D; j += 16) {
        const __m512 v = load16(xi + j, D - j);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float ri = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(D) + eps);
      r[i] = ri;
      const __m512 vr = _mm512_set1_ps(ri);
      for (int64_t j = 0; j < D; j += 16)
        store16(y + i * D + j, _mm512_mul_ps(_mm512_mul_ps(load16(xi + j, D - j), vr), load16(w + j, D - j)),
                D - j);
    }
  });
}

template <typename TX, typename TG>
void backward_rows(const TG* g, const TX* x, const float* w, const float* r, TX* dx, float* dw_parts,
                   int64_t N, int64_t D) {
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    float* dw = dw_parts + at::get_thread_num() * D;
    for (int64_t i = lo; i < hi; ++i) {
      const TX* xi = x + i * D;
      const TG* gi = g + i * D;
      const __m512 vr = _mm512_set1_ps(r[i]);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < D; j += 16) {
        const __m512 xh = _mm512_mul_ps(load16(xi + j, D - j), vr);
        const __m512 gv = load16(gi + j, D - j);
        acc = _mm512_fmadd_ps(_mm512_mul_ps(gv, load16(w + j, D - j)), xh, acc);
        store16(dw + j, _mm512_fmadd_ps(gv, xh, load16(dw + j, D - j)), D - j);
      }
      const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(acc) / static_cast<float>(D));
      for (int64_t j = 0; j < D; j += 16) {
        const __m512 xh = _mm512_mul_ps(load16(xi + j, D - j), vr);
        const __m512 gw = _mm512_mul_ps(load16(gi + j, D - j), load16(w + j, D - j));
        store16(dx + i * D + j, _mm512_mul_ps(vr, _mm512_sub_ps(gw, _mm512_mul_ps(xh, mean))), D - j);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              "cpu rmsnorm: ", what, " must be a contiguous float32 or bf16 [N, D] tensor");
}

}  // namespace

// (y [N, D] in out_dtype, r [N] float32) for x [N, D], weight [D] float32.
std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(at::Tensor x, at::Tensor w, double eps, at::ScalarType out_dtype) {
  check_rows(x, "x");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1), "cpu rmsnorm: float32 weight [D]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "cpu rmsnorm: float32 or bf16 output");
  const int64_t N = x.size(0), D = x.size(1);
  auto y = at::empty({N, D}, x.options().dtype(out_dtype));
  auto r = at::empty({N}, x.options().dtype(at::kFloat));
  const float* wp = w.const_data_ptr<float>();
  const float e = static_cast<float>(eps);
  float* rp = r.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    if (out_dtype == at::kFloat) forward_rows(x.const_data_ptr<float>(), wp, y.data_ptr<float>(), rp, N, D, e);
    else forward_rows(x.const_data_ptr<float>(), wp, y.data_ptr<BFloat16>(), rp, N, D, e);
  } else {
    if (out_dtype == at::kFloat) forward_rows(x.const_data_ptr<BFloat16>(), wp, y.data_ptr<float>(), rp, N, D, e);
    else forward_rows(x.const_data_ptr<BFloat16>(), wp, y.data_ptr<BFloat16>(), rp, N, D, e);
  }
  return {y, r};
}

// (dx [N, D] in x's dtype, dw [D] float32) for the output gradient g [N, D].
std::tuple<at::Tensor, at::Tensor> rmsnorm_backward(at::Tensor g, at::Tensor x, at::Tensor w, at::Tensor r) {
  check_rows(g, "g");
  check_rows(x, "x");
  TORCH_CHECK(g.sizes() == x.sizes() && r.scalar_type() == at::kFloat && r.is_contiguous() && r.numel() == x.size(0),
              "cpu rmsnorm: g like x, float32 r [N]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1), "cpu rmsnorm: float32 weight [D]");
  const int64_t N = x.size(0), D = x.size(1), T = at::get_num_threads();
  auto dx = at::empty_like(x);
  auto parts = at::zeros({T, D}, x.options().dtype(at::kFloat));
  const float *wp = w.const_data_ptr<float>(), *rp = r.const_data_ptr<float>();
  float* pp = parts.data_ptr<float>();
  const bool xf = x.scalar_type() == at::kFloat, gf = g.scalar_type() == at::kFloat;
  if (xf && gf) backward_rows(g.const_data_ptr<float>(), x.const_data_ptr<float>(), wp, rp, dx.data_ptr<float>(), pp, N, D);
  else if (xf) backward_rows(g.const_data_ptr<BFloat16>(), x.const_data_ptr<float>(), wp, rp, dx.data_ptr<float>(), pp, N, D);
  else if (gf) backward_rows(g.const_data_ptr<float>(), x.const_data_ptr<BFloat16>(), wp, rp, dx.data_ptr<BFloat16>(), pp, N, D);
  else backward_rows(g.const_data_ptr<BFloat16>(), x.const_data_ptr<BFloat16>(), wp, rp, dx.data_ptr<BFloat16>(), pp, N, D);
  return {dx, parts.sum(0)};
}

}  // namespace longctx
