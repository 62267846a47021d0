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

// Adam's step numbers kept on the device (the optimizer's `step` state, one fp32 count per
// tensor, advanced by the caller before the step and not on a skipped one): the two terms of
// AdamArgs that depend on the step follow from them per tensor, computed as make_adam_args
// computes them on the host (in double, then rounded to fp32). `steps` null: the AdamArgs as given.
// `lr_device` (with `steps` only): the learning rate read where the step runs instead of `lr`
// (a CUDA graph replays with the rate the tensor holds), AdamW's decay following from it.
struct AdamSteps {
  const float* steps = nullptr;  // indexed by the tensor's position in the caller's lists
  double lr = 0.0;
  double beta1 = 0.0;
  double beta2 = 0.0;
  const double* lr_device = nullptr;
  double weight_decay = 0.0;  // (read with lr_device only)
  bool decoupled = false;
};

// lr * weight_decay rounded once, as the host computes it (no fused multiply-add on a GPU).
AMP_HD double product(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

AMP_HD AdamArgs adam_at_step(const AdamArgs& base, const AdamSteps& s, int64_t position) {
  if (s.steps == nullptr) return base;
  AdamArgs a = base;
  const double lr = s.lr_device != nullptr ? *s.lr_device : s.lr;
  const double step = static_cast<double>(s.steps[position]);
  a.step_size = static_cast<float>(lr / (1.0 - ::pow(s.beta1, step)));
  a.bias_correction2_sqrt = static_cast<float>(::sqrt(1.0 - ::pow(s.beta2, step)));
  if (s.lr_device != nullptr && s.decoupled) {
    a.decay = static_cast<float>(1.0 - product(lr, s.weight_decay));
  }
  return a;
}

// SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD).
struct SgdArgs {
  float lr;
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  bool first_run;  // the momentum buffer is new: it starts as the gradient (no dampening)
  const double* lr_device = nullptr;  // where given, the learning rate read where the step runs
};

// `s` with its learning rate read from `lr_device` where given (rounded to fp32 as on the host).
AMP_HD SgdArgs sgd_now(const SgdArgs& s) {
  if (s.lr_device == nullptr) return s;
  SgdArgs now = s;
  now.lr = static_cast<float>(*s.lr_device);
  return now;
}

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

// ---- the dynamic loss scale's update ---------------------------------------------------------
// runner.precision.scaler.LossScaler.update in one step: `state` is the scaler's three float64
// numbers [scale, clean steps since the scale last changed, overflows still tolerated before a
// back-off (hysteresis)], updated exactly as the scaler's tensor ops update them (the same
// float64 operations in the same order), then the fp32 scale and inverse scale the loss and the
// gradients use. An overflow decrements the hysteresis counter (not below 0) and backs off
// (times backoff_factor, not below min_scale where has_min) once it is 0; growth_interval clean
// steps in a row grow the scale (times growth_factor, not above max_scale) and refill the
// counter. `found`: the verdict; `apply` false: the state stays (only the fp32 values follow it).
struct ScaleUpdate {
  double growth_factor;
  double backoff_factor;
  double growth_interval;
  double min_scale;  // (only where has_min)
  double max_scale;
  double hysteresis;
  bool has_min;
};

AMP_HD void update_scale_state(double* state, float* scale32, float* inv32, bool found,
                               bool apply, const ScaleUpdate& u) {
  if (apply) {
    const double scale = state[0];
    double unskipped = state[1];
    double left = state[2];
    if (found) left = left - 1.0 < 0.0 ? 0.0 : left - 1.0;  // (a NaN stays NaN, as clamp's)
    const bool back = found && left == 0.0;
    unskipped = found ? 0.0 : unskipped + 1.0;
    const bool grow = !found && unskipped >= u.growth_interval;
    double backed = scale * u.backoff_factor;
    if (u.has_min && backed < u.min_scale) backed = u.min_scale;
    double grown = scale * u.growth_factor;
    if (grown > u.max_scale) grown = u.max_scale;
    state[0] = back ? backed : (grow ? grown : scale);
    state[1] = grow ? 0.0 : unskipped;
    state[2] = grow ? u.hysteresis : left;
  }
  scale32[0] = static_cast<float>(state[0]);
  inv32[0] = static_cast<float>(1.0 / state[0]);
}

// ---- stochastic rounding fp32 -> bf16 ----------------------------------------------------
// For bf16 weights stepped without fp32 masters: an update smaller than half of bf16's spacing
// (the spacing is 2^-8 to 2^-7 of the value) is lost by round-to-nearest every time; rounded
// stochastically it moves the weight by one spacing with probability (update / spacing), so it
// is not lost on average.
//
// Random bits are a pure function of (seed, step, tensor id, element index) -- a counter-based
// generator, no state -- so they do not depend on threads, spans, chunks or launch geometry, and
// a resumed run draws exactly the bits the uninterrupted run would have drawn. Definition (all
// arithmetic on uint32, wrapping; lo/hi are the low/high 32 bits of a 64-bit value):
//
//   mix(x)        = lowbias32: x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B;
//                   x ^= x >> 16   (a bijection of uint32 with low avalanche bias)
//   k1            = mix(mix(mix(mix(mix(lo(seed) ^ 0x9E3779B9) ^ hi(seed)) ^ lo(step))
//                       ^ hi(step)) ^ tensor_id)
//   k2            = mix(k1 ^ 0x85EBCA6B)
//   bits(i)       = mix(mix(lo(i) ^ k1) ^ k2 ^ hi(i))       i: the element's index in memory order
//   r(i)          = bits(i) >> 16                           (16 random bits)
//
// The optimizer state of a rounded step (bf16 momentum, Adam's moments) is rounded the same way
// with its own stream of bits: stream s (1: momentum buffer or exp_avg, 2: exp_avg_sq) of a
// tensor's key (k1, k2) is
//   k1_s          = mix(k1 ^ mix(s ^ 0x5BD1E995)),   k2_s = mix(k1_s ^ 0x85EBCA6B).
//
// For fixed other inputs, k1 is a bijection of tensor_id and of lo(step), so two tensors, or two
// steps with the same high word (any two below 2^32), never share a key; bits(i) is a bijection
// of lo(i). The same
// definition is written in torch integer ops in runner/precision/rounding.py, bit for bit.
struct SrKey {
  uint32_t k1;
  uint32_t k2;
};

AMP_HD uint32_t sr_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

AMP_HD SrKey sr_key(uint64_t seed, uint64_t step, uint32_t tensor_id) {
  uint32_t h = sr_mix(static_cast<uint32_t>(seed) ^ 0x9E3779B9u);
  h = sr_mix(h ^ static_cast<uint32_t>(seed >> 32));
  h = sr_mix(h ^ static_cast<uint32_t>(step));
  h = sr_mix(h ^ static_cast<uint32_t>(step >> 32));
  h = sr_mix(h ^ tensor_id);
  return SrKey{h, sr_mix(h ^ 0x85EBCA6Bu)};
}

// The key of stream s (>= 1) of a tensor's optimizer state (see above).
AMP_HD SrKey sr_stream(const SrKey& key, uint32_t s) {
  const uint32_t k1 = sr_mix(key.k1 ^ sr_mix(s ^ 0x5BD1E995u));
  return SrKey{k1, sr_mix(k1 ^ 0x85EBCA6Bu)};
}

AMP_HD uint32_t sr_bits(const SrKey& key, uint32_t index_lo, uint32_t index_hi) {
  return sr_mix(sr_mix(index_lo ^ key.k1) ^ key.k2 ^ index_hi);
}

AMP_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

// The bf16 bit pattern of x rounded stochastically with the random word `bits` (its top 16 bits
// are used): r = bits >> 16 is added to x's fp32 bit pattern and the low 16 bits are cut off.
// Between two neighbouring bf16 values lo < |x| < hi (same sign) the fp32 patterns are evenly
// spaced in value, so |x| becomes hi with probability exactly (|x| - lo) / (hi - lo) over the
// 2^16 values of r (unbiased), else lo; a value that bf16 represents (low 16 bits zero) never
// changes, and the result is always one of the two neighbours. Signs are symmetric (the
// magnitude is rounded). Zeros (either sign) and +-inf stay as they are; NaN becomes the quiet
// NaN 0x7FC0, as torch's round-to-nearest conversion does. Subnormals are rounded like any other
// value (bf16 has fp32's exponent range, its subnormals are fp32's cut to 16 bits; nothing is
// flushed). A finite value above bf16's largest finite value (0x7F7F, about 3.39e38) rounds to it
// or to inf, inf with probability (|x| - max) / 2^120, as if inf were the next value (round to
// nearest sends such values to inf from max + 2^119 on).
AMP_HD uint16_t sr_round_bf16(float x, uint32_t bits) {
  const uint32_t u = float_bits(x);
  const uint16_t rounded = static_cast<uint16_t>((u + (bits >> 16)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : rounded;
}

// Non-finite (inf or NaN) test on the bits: the exponent field is all ones. Vectorises on the
// host (no call to isfinite) and reads 16-bit values without converting them.
AMP_HD bool nonfinite_bits32(uint32_t bits) { return (bits & 0x7F800000u) == 0x7F800000u; }
AMP_HD bool nonfinite_bits_fp16(uint16_t bits) { return (bits & 0x7C00u) == 0x7C00u; }
AMP_HD bool nonfinite_bits_bf16(uint16_t bits) { return (bits & 0x7F80u) == 0x7F80u; }

}  // namespace amp_runner
