// The extension's entry points, one family per .cpp beside this file; bindings.cpp exposes them to
// Python under these names (cp_attention/native.py builds the whole folder as one module).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace longctx {

// attention_fwd.cpp: causal self-attention over the documents of a packed row (bf16).
std::vector<at::Tensor> varlen_causal_forward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cu_seqlens,
                                              double scale);

// attention_bwd.cpp: its backward.
std::vector<at::Tensor> varlen_causal_backward(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v,
                                               at::Tensor out, at::Tensor lse, at::Tensor cu_seqlens, double scale,
                                               int64_t block_q, int64_t block_k);

// logprobs.cpp: the log-prob head's softmax work on bf16 logits.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_stats(const at::Tensor& z, const at::Tensor& labels,
                                                             double temperature, bool entropy);
at::Tensor backward_grad_(at::Tensor z, const at::Tensor& labels, const at::Tensor& lse, const at::Tensor& ent,
                          const at::Tensor& g_logp, const at::Tensor& g_ent, double temperature);

// rmsnorm.cpp
std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(at::Tensor x, at::Tensor w, double eps, at::ScalarType out_dtype);
std::tuple<at::Tensor, at::Tensor> rmsnorm_backward(at::Tensor g, at::Tensor x, at::Tensor w, at::Tensor r);

// swiglu.cpp
at::Tensor swiglu_forward(at::Tensor h);
std::tuple<at::Tensor, at::Tensor> swiglu_backward(at::Tensor h, at::Tensor dact);

}  // namespace longctx
