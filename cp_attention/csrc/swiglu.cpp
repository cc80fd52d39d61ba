// The experts' SwiGLU activation on CPU rows h = [gate | up] ([M, 2F], float32 or bf16), one pass
// per direction (AVX512):
//   forward:  act = silu(gate) * up
//   backward: act (recomputed, for the weight gradient of the down projection),
//             d up = dact * silu(gate),  d gate = (dact * up) * s (1 + gate (1 - s)),  s = sigmoid(gate)
// with the arithmetic and roundings of the torch path in model/moe.py (_SwiGLUDown): silu as aten
// computes it (x / (1 + exp(-x)) in float32 with at::vec's exp), each intermediate rounded to the
// rows' dtype where the torch path stores it, aten's silu_backward formula. Where aten runs its
// vector loop over whole rows (two vectors a step: rows of a multiple of 64 bf16 / 32 float32
// values) the two agree bitwise on the same machine; on the rest of a row aten's scalar loop uses
// std::exp, a few roundings away.
// The torch path makes five elementwise passes over [M, F] for the backward (each a fresh
// tensor); this is one, and one for the forward instead of two.

#include "common.h"
#include "kernels.h"

#include <ATen/cpu/vec/vec.h>

namespace longctx {
namespace {

using Vec = at::vec::Vectorized<float>;

// The value a store to T and a reload would give: a bf16 rounding, or nothing.
template <typename T>
inline Vec round_to(const Vec& v);
template <>
inline Vec round_to<float>(const Vec& v) { return v; }
template <>
inline Vec round_to<BFloat16>(const Vec& v) { return Vec(widen(bf16x16(v))); }

template <typename T>
inline Vec load(const T* p, int64_t n) { return Vec(load16(p, n)); }
template <typename T>
inline void store(T* p, const Vec& v, int64_t n) { store16(p, v, n); }

constexpr int64_t kW = Vec::size();

// 1 + exp(-x): the denominator of aten's silu, x / (1 + exp(-x)), and of its sigmoid in
// silu_backward, 1 / (1 + exp(-x)) (one exp serves both: the same value either way).
inline Vec one_plus_exp_neg(const Vec& x) { return Vec(1.f) + x.neg().exp(); }

template <typename T>
void forward_rows(const T* h, T* act, int64_t M, int64_t F) {
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* gate = h + i * 2 * F;
      const T* up = gate + F;
      for (int64_t j = 0; j < F; j += kW) {
        const int64_t n = std::min(kW, F - j);
        const Vec g = load(gate + j, n);
        store(act + i * F + j, round_to<T>(g / one_plus_exp_neg(g)) * load(up + j, n), n);  // silu stored in T
      }
    }
  });
}

template <typename T>
void backward_rows(const T* h, const T* dact, T* act, T* dh, int64_t M, int64_t F) {
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* gate = h + i * 2 * F;
      const T* up = gate + F;
      const T* da = dact + i * F;
      for (int64_t j = 0; j < F; j += kW) {
        const int64_t n = std::min(kW, F - j);
        const Vec g = load(gate + j, n), u = load(up + j, n), d = load(da + j, n);
        const Vec denom = one_plus_exp_neg(g);
        const Vec s = round_to<T>(g / denom);          // silu, stored by the torch path
        store(act + i * F + j, s * u, n);
        store(dh + i * 2 * F + F + j, d * s, n);       // d up
        const Vec du = round_to<T>(d * u);             // dact * up, stored by the torch path
        const Vec sig = Vec(1.f) / denom;
        store(dh + i * 2 * F + j, du * sig * (Vec(1.f) + g * (Vec(1.f) - sig)), n);  // d gate
      }
    }
  });
}

void check(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              "cpu swiglu: ", what, " must be a contiguous float32 or bf16 [M, *] tensor");
}

}  // namespace

// act [M, F] for h [M, 2F].
at::Tensor swiglu_forward(at::Tensor h) {
  check(h, "h");
  TORCH_CHECK(h.size(1) % 2 == 0, "cpu swiglu: h must be [M, 2F]");
  const int64_t M = h.size(0), F = h.size(1) / 2;
  auto act = at::empty({M, F}, h.options());
  if (h.scalar_type() == at::kFloat) forward_rows(h.const_data_ptr<float>(), act.data_ptr<float>(), M, F);
  else forward_rows(h.const_data_ptr<BFloat16>(), act.data_ptr<BFloat16>(), M, F);
  return act;
}

// (act [M, F], dh [M, 2F]) for h [M, 2F] and the activation's gradient dact [M, F], all one dtype.
std::tuple<at::Tensor, at::Tensor> swiglu_backward(at::Tensor h, at::Tensor dact) {
  check(h, "h");
  check(dact, "dact");
  const int64_t M = h.size(0), F = h.size(1) / 2;
  TORCH_CHECK(h.size(1) == 2 * F && dact.size(0) == M && dact.size(1) == F && dact.scalar_type() == h.scalar_type(),
              "cpu swiglu: dact must be [M, F] of h's dtype for h [M, 2F]");
  auto act = at::empty({M, F}, h.options());
  auto dh = at::empty_like(h);
  if (h.scalar_type() == at::kFloat)
    backward_rows(h.const_data_ptr<float>(), dact.const_data_ptr<float>(), act.data_ptr<float>(), dh.data_ptr<float>(), M, F);
  else
    backward_rows(h.const_data_ptr<BFloat16>(), dact.const_data_ptr<BFloat16>(), act.data_ptr<BFloat16>(),
                  dh.data_ptr<BFloat16>(), M, F);
  return {act, dh};
}

}  // namespace longctx
