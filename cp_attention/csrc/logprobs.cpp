// The log-prob head's softmax work on bf16 logits, one pass per row in each direction (AVX512).
//
// For the rows of one LM-head chunk z [C, V] (bf16, the product h W^T under bf16 autocast) and a
// temperature t, with x = float(z) / t, computed in float32:
//   forward:  m = max x,  s = sum exp(x - m),  a = sum exp(x - m) (x - m)
//             lse = m + log s,  logp_y = x_y - lse,  H = log s - a / s   (the row's entropy)
//   backward: p = exp(x - lse)
//             dz = (g_logp (onehot_y - p) - g_ent p (x - lse + H)) / t,  rounded once to bf16
//             and written over z (the caller hands over logits it no longer needs).
// This is the arithmetic of model.losses' torch path (log_softmax / softmax in float32, the
// gradient rounded to bf16 once) and of the Triton head (kernels/triton_logprobs.py), without
// torch's three bf16 <-> float32 copies and separate elementwise passes over [C, V] per chunk:
// those passes, not the products, were half the head's time on a CPU core.
// Rows are independent; at::parallel_for splits them over the intra-op threads.

#include "common.h"
#include "kernels.h"

#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>

namespace longctx {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 16 bf16 values (or the first n of them, the rest reading as `fill`) as float32.
inline __m512 load16_or(const BFloat16* p, int64_t n, float fill) {
  return _mm512_mask_blend_ps(head(n), _mm512_set1_ps(fill), load16(p, n));
}

inline float to_float(BFloat16 v) { return static_cast<float>(v); }

struct Stats {
  float lse, ent, logp;
};

// x = z / t, divided as torch's z.float() / temperature is (t = 1 leaves z exact either way).
inline __m512 scaled(const BFloat16* z, int64_t n, float fill, __m512 vt) {
  return _mm512_div_ps(load16_or(z, n, fill), vt);
}

Stats row_stats(const BFloat16* z, int64_t V, int64_t y, float t, bool entropy) {
  const __m512 vt = _mm512_set1_ps(t);
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < V; j += 16) mx = _mm512_max_ps(mx, scaled(z + j, V - j, kNegInf, vt));
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 s = _mm512_setzero_ps(), a = _mm512_setzero_ps();
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 k = head(V - j);
    const __m512 d = _mm512_sub_ps(scaled(z + j, V - j, 0.f, vt), vm);
    const __m512 e = _mm512_maskz_mov_ps(k, Vec(d).exp());
    s = _mm512_add_ps(s, e);
    if (entropy) a = _mm512_fmadd_ps(e, _mm512_maskz_mov_ps(k, d), a);
  }
  const float sum = _mm512_reduce_add_ps(s), log_s = std::log(sum);
  const float lse = m + log_s;
  const float ent = entropy ? log_s - _mm512_reduce_add_ps(a) / sum : 0.f;
  return {lse, ent, (to_float(z[y]) / t - m) - log_s};  // log_softmax's order: (x - m) - log s
}

// The torch path's operations in its order (p (-g_logp), the one-hot's + g_logp, the entropy
// term, / t), each rounded to float32, then one rounding to bf16.
inline __m512 grad16(__m512 lp, __m512 vg, __m512 vge, __m512 vh, __m512 vt, bool entropy) {
  const __m512 p = Vec(lp).exp();
  __m512 d = _mm512_mul_ps(p, vg);
  if (entropy) d = _mm512_sub_ps(d, _mm512_mul_ps(_mm512_mul_ps(vge, p), _mm512_add_ps(lp, vh)));
  return _mm512_div_ps(d, vt);
}

void row_grad(BFloat16* z, int64_t V, int64_t y, float t, float lse, float ent,
              float g_logp, float g_ent, bool entropy) {
  const float lp_y = to_float(z[y]) / t - lse;  // read before the row is overwritten
  const __m512 vt = _mm512_set1_ps(t), vlse = _mm512_set1_ps(lse), vh = _mm512_set1_ps(ent);
  const __m512 vg = _mm512_set1_ps(-g_logp), vge = _mm512_set1_ps(g_ent);
  for (int64_t j = 0; j < V; j += 16) {
    const __m512 lp = _mm512_sub_ps(scaled(z + j, V - j, 0.f, vt), vlse);  // log p
    store16(z + j, grad16(lp, vg, vge, vh, vt, entropy), V - j);
  }
  // The label's value again, with the one-hot term added before its single rounding.
  const float p_y = std::exp(lp_y);
  float d_y = p_y * -g_logp + g_logp;
  if (entropy) d_y -= g_ent * p_y * (lp_y + ent);
  z[y] = BFloat16(d_y / t);
}

void check(const at::Tensor& z, const at::Tensor& labels) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kBFloat16 && z.is_contiguous() && z.device().is_cpu(),
              "cpu log-prob head: contiguous bf16 [C, V] logits on the CPU expected");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == z.size(0) && labels.scalar_type() == at::kLong,
              "cpu log-prob head: int64 labels [C] expected");
}

}  // namespace

// (logp [C], ent [C] (zeros without entropy), lse [C]), float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_stats(const at::Tensor& z, const at::Tensor& labels,
                                                             double temperature, bool entropy) {
  check(z, labels);
  const int64_t C = z.size(0), V = z.size(1);
  auto opts = z.options().dtype(at::kFloat);
  auto logp = at::empty({C}, opts), ent = at::zeros({C}, opts), lse = at::empty({C}, opts);
  const auto* zp = z.const_data_ptr<BFloat16>();
  const auto* yp = labels.const_data_ptr<int64_t>();
  auto *lp = logp.data_ptr<float>(), *ep = ent.data_ptr<float>(), *sp = lse.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  for (int64_t r = 0; r < C; ++r)
    TORCH_CHECK(yp[r] >= 0 && yp[r] < V, "cpu log-prob head: label out of range");
  at::parallel_for(0, C, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Stats st = row_stats(zp + r * V, V, yp[r], t, entropy);
      lp[r] = st.logp, ep[r] = st.ent, sp[r] = st.lse;
    }
  });
  return {logp, ent, lse};
}

// Writes d loss / d z (bf16) over z and returns it. g_ent empty: no entropy term.
at::Tensor backward_grad_(at::Tensor z, const at::Tensor& labels, const at::Tensor& lse,
                          const at::Tensor& ent, const at::Tensor& g_logp, const at::Tensor& g_ent,
                          double temperature) {
  check(z, labels);
  const int64_t C = z.size(0), V = z.size(1);
  const bool entropy = g_ent.numel() > 0;
  for (const auto* t : {&lse, &ent, &g_logp})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == C,
                "cpu log-prob head: float32 [C] row statistics and gradients expected");
  TORCH_CHECK(!entropy || (g_ent.scalar_type() == at::kFloat && g_ent.is_contiguous() && g_ent.numel() == C),
              "cpu log-prob head: float32 [C] entropy gradient expected");
  auto* zp = z.data_ptr<BFloat16>();
  const auto* yp = labels.const_data_ptr<int64_t>();
  const float *sp = lse.const_data_ptr<float>(), *ep = ent.const_data_ptr<float>();
  const float *gl = g_logp.const_data_ptr<float>(), *ge = entropy ? g_ent.const_data_ptr<float>() : nullptr;
  const float t = static_cast<float>(temperature);
  for (int64_t r = 0; r < C; ++r)
    TORCH_CHECK(yp[r] >= 0 && yp[r] < V, "cpu log-prob head: label out of range");
  at::parallel_for(0, C, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      row_grad(zp + r * V, V, yp[r], t, sp[r], ep[r], gl[r], entropy ? ge[r] : 0.f, entropy);
  });
  return z;
}

}  // namespace longctx
