// Per-element arithmetic shared by the C++ (CPU) and CUDA backends, so both compute the same
// thing: one set of semantics, two backends. Everything is fp32 (the masters, the optimizer
// state and the accumulators); 16-bit values are converted on load and store by the backends.
//
// The formulas follow torch.optim's single-tensor implementations term by term (same order of
// operations where it matters), so results agree with torch.optim on fp32 parameters to a few
// ulps. Options that are off cost nothing and change nothing: a weight decay of 0 adds 0 * p,
// a decay factor of 1 multiplies by 1, both exact for finite values.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define AMP_HD __host__ __device__ __forceinline__
#else
#define AMP_HD inline
#endif

namespace amp_runner {

// Adam / AdamW, with everything that depends only on the step number precomputed on the host.
struct AdamArgs {
  float beta1;
  float beta2;
  float one_minus_beta1;  // lerp weight of exp_avg towards the gradient
  float one_minus_beta2;
  float eps;
  float step_size;        // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float l2_weight_decay;  // Adam: grad += wd * param (0 for AdamW)
  float decay;            // AdamW: param *= 1 - lr * wd (1 for Adam)
};

// SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD).
struct SgdArgs {
  float lr;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  bool first_run;  // the momentum buffer is new: it starts as the gradient (no dampening)
};

// `g` is the true gradient: the stored one times the gradient multiplier (inverse loss scale
// times the clipping coefficient, negated for `maximize`).
AMP_HD void adam_update(float& p, float& m, float& v, float g, const AdamArgs& a) {
  p = p * a.decay;
  g = g + a.l2_weight_decay * p;
  // torch.lerp(m, g, w): m + w * (g - m) for w < 0.5, else g - (g - m) * (1 - w)
  m = a.one_minus_beta1 < 0.5f ? m + a.one_minus_beta1 * (g - m) : g - (g - m) * a.beta1;
  v = v * a.beta2 + a.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / a.bias_correction2_sqrt + a.eps;
  p = p + (-a.step_size) * m / denom;
}

AMP_HD void sgd_update(float& p, float& buf, float g, const SgdArgs& s) {
  g = g + s.weight_decay * p;
  if (s.momentum != 0.f) {
    buf = s.first_run ? g : buf * s.momentum + s.one_minus_dampening * g;
    g = s.nesterov ? g + s.momentum * buf : buf;
  }
  p = p + (-s.lr) * g;
}

// Non-finite (inf or NaN) test on the bits: the exponent field is all ones. Vectorises on the
// host (no call to isfinite) and reads 16-bit values without converting them.
AMP_HD bool nonfinite_bits32(uint32_t bits) { return (bits & 0x7F800000u) == 0x7F800000u; }
AMP_HD bool nonfinite_bits_fp16(uint16_t bits) { return (bits & 0x7C00u) == 0x7C00u; }
AMP_HD bool nonfinite_bits_bf16(uint16_t bits) { return (bits & 0x7F80u) == 0x7F80u; }

}  // namespace amp_runner
