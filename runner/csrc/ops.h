// The kernels' interface, identical for the C++ (CPU) and CUDA backends, and the argument checks
// both run before touching memory. Each backend implements these functions in its own namespace
// and binds them with AMP_RUNNER_BIND_OPS, so Python sees the same module API from either.
//
// Lists: tensors at the same position in the lists of one call are elementwise partners (a
// gradient, its parameter, its optimizer state, its 16-bit model copy). Partners must have the
// same number of elements and the same layout (contiguous or channels_last alike: any dense,
// non-overlapping layout works, elementwise over memory). Dtypes may differ between positions
// and lists (fp16/bf16/fp32 gradients in one list); parameters and optimizer state are fp32,
// except in the stochastic-rounding steps (bf16 params; bf16 or fp32 state).
// Scale and flag arguments are one-element fp32 tensors on the tensors' device, so a gradient
// multiplier computed on the GPU (a clipping coefficient) needs no host round trip.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "step_math.h"

namespace amp_runner {

// Error messages built without iostreams. TORCH_CHECK formats its arguments with an
// std::ostringstream compiled into this module; where the toolchain links libstdc++ statically
// into a shared object (the GPU image's /opt/gcc does), that copy's locale facets do not match
// the process's, and inserting a number crashed the process (CUDA, a segfault) or cut the message
// short at the first number (CPU). Numbers go through std::to_string (no locale), devices through
// c10's own Device::str (in libc10), and TORCH_CHECK receives one finished std::string, which it
// passes through without a stream.
namespace fmt {
inline std::string part(const char* s) { return s; }
inline std::string part(const std::string& s) { return s; }
inline std::string part(bool b) { return b ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline std::string part(T v) { return std::to_string(v); }
inline std::string part(const c10::Device& d) { return d.str(); }
inline std::string part(at::ScalarType t) { return c10::toString(t); }
inline std::string part(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string out;
  ((out += part(parts)), ...);
  return out;
}
}  // namespace fmt

// TORCH_CHECK with the message made by fmt::cat (only when the check fails).
#define AMP_CHECK(cond, ...) TORCH_CHECK(cond, ::amp_runner::fmt::cat(__VA_ARGS__))

using TensorList = std::vector<at::Tensor>;

inline bool is_half_or_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// One-element fp32 tensor on `device`.
inline void check_scalar(const at::Tensor& t, const char* name, const at::Device& device) {
  AMP_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat,
              name, " must be a one-element float32 tensor, got ", t.scalar_type(), " with ",
              t.numel(), " elements");
  AMP_CHECK(t.device() == device, name, " is on ", t.device(), ", the tensors on ", device);
}

// `lists[0]` is the reference list; every other list has its length (or is empty where
// `optional[i]`), and partners share numel, strides and device. `fp32[i]`: list i must be fp32.
inline void check_lists(const char* op, const std::vector<const TensorList*>& lists,
                        const std::vector<const char*>& names, const std::vector<bool>& optional,
                        const std::vector<bool>& fp32) {
  const TensorList& ref = *lists[0];
  for (size_t l = 0; l < lists.size(); ++l) {
    const TensorList& list = *lists[l];
    if (list.empty() && optional[l]) continue;
    AMP_CHECK(list.size() == ref.size(), op, ": ", names[l], " has ", list.size(),
                " tensors, ", names[0], " has ", ref.size());
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& t = list[i];
      const at::Tensor& r = ref[i];
      AMP_CHECK(t.defined(), op, ": ", names[l], "[", i, "] is undefined");
      AMP_CHECK(!t.is_sparse(), op, ": ", names[l], "[", i, "] is sparse");
      AMP_CHECK(is_half_or_float(t.scalar_type()), op, ": ", names[l], "[", i, "] is ",
                  t.scalar_type(), "; float16, bfloat16 or float32 expected");
      AMP_CHECK(!fp32[l] || t.scalar_type() == at::kFloat, op, ": ", names[l], "[", i,
                  "] must be float32, got ", t.scalar_type());
      AMP_CHECK(t.is_non_overlapping_and_dense(), op, ": ", names[l], "[", i,
                  "] is not dense (a strided view); pass the whole tensor");
      AMP_CHECK(t.numel() == r.numel(), op, ": ", names[l], "[", i, "] has ", t.numel(),
                  " elements, ", names[0], "[", i, "] has ", r.numel());
      AMP_CHECK(t.numel() <= 1 || t.strides() == r.strides(), op, ": ", names[l], "[", i,
                  "] and ", names[0], "[", i, "] have different layouts (strides ", t.strides(),
                  " vs ", r.strides(), ")");
      AMP_CHECK(t.device() == ref[0].device(), op, ": ", names[l], "[", i, "] is on ",
                  t.device(), ", ", names[0], "[0] on ", ref[0].device());
    }
  }
}

// out[i] = grads[i] * inv_scale (out[i] may be grads[i] itself: in place); found_inf = 1 if
// any gradient holds inf/NaN.
void unscale_check(const TensorList& grads, const TensorList& out, const at::Tensor& inv_scale,
                   const at::Tensor& found_inf);
// found_inf = 1 if any tensor holds inf/NaN; reads only.
void check_finite(const TensorList& tensors, const at::Tensor& found_inf);
// (total L2 norm, per-tensor L2 norms) of scale * tensors, accumulated in fp32 per chunk and
// fp64 across chunks; inf/NaN propagate into the norms and also set found_inf when given.
std::tuple<at::Tensor, at::Tensor> l2norm(const TensorList& tensors, const at::Tensor& scale,
                                          const std::optional<at::Tensor>& found_inf);
// dst[i] = src[i] * scale, converted to dst's dtype (fp32 masters -> 16-bit model).
void copy_scale(const TensorList& src, const TensorList& dst, const at::Tensor& scale);
// One SGD step on fp32 params from grads * grad_scale; writes the 16-bit model copies when
// given (an empty list: none; params[i] itself at position i: none for that param). Does nothing
// when found_inf is given and set.
void sgd_step(const TensorList& params, const TensorList& grads, const TensorList& momentum_bufs,
              const TensorList& model_copies, const at::Tensor& grad_scale,
              const std::optional<at::Tensor>& found_inf, double lr, double weight_decay,
              double momentum, double dampening, bool nesterov, bool maximize, bool first_run,
              const std::optional<at::Tensor>& lr_tensor);
// One Adam/AdamW step, same conventions as sgd_step. The bias corrections: from `steps` when
// given (one fp32 step number per param, position i for params[i], on the params' device: the
// optimizer's step counters, already advanced for this step), else the two given here.
// `lr_tensor` (both steps; for Adam with `steps` only): a one-element float64 tensor on the
// params' device that replaces `lr`, read when the step runs (on a GPU, by the kernels: a
// captured step replays with the rate the tensor holds then); the results are those of `lr`
// given as the same number.
void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const TensorList& model_copies,
               const at::Tensor& grad_scale, const std::optional<at::Tensor>& found_inf,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               double bias_correction1, double bias_correction2, bool decoupled, bool maximize,
               const std::optional<at::Tensor>& steps, const std::optional<at::Tensor>& lr_tensor);

// `lr_tensor` checked (one float64 number on `device`); null where not given.
inline const double* lr_pointer(const char* op, const std::optional<at::Tensor>& lr_tensor,
                                const at::Device& device) {
  if (!lr_tensor.has_value() || !lr_tensor->defined()) return nullptr;
  const at::Tensor& t = *lr_tensor;
  AMP_CHECK(t.numel() == 1 && t.scalar_type() == at::kDouble, op,
            ": lr_tensor must be a one-element float64 tensor, got ", t.scalar_type(), " with ",
            t.numel(), " elements");
  AMP_CHECK(t.device() == device, op, ": lr_tensor is on ", t.device(), ", the params on ",
            device);
  return t.data_ptr<double>();
}

// Stochastic rounding (see step_math.h): random bits per element from (seed, step, tensor id,
// element index in memory order). `tensor_ids[i]` names list position i, in [0, 2^32): the
// caller passes an id that is stable across runs and resumes (a param's index in its optimizer).
//
// dst[i] = src[i] rounded stochastically to bf16 (src fp32, dst bf16).
void stochastic_round(const TensorList& src, const TensorList& dst, uint64_t seed, uint64_t step,
                      const std::vector<int64_t>& tensor_ids);
// One SGD step on bf16 params updated in place, without fp32 masters: each param and its state
// are loaded to fp32, updated by sgd_update (the same math as sgd_step), the state is stored back
// in its own dtype (bf16 or fp32; bf16 rounded to nearest even) and the param rounded
// stochastically. Grads in any of fp16/bf16/fp32. Does nothing when found_inf is given and set.
void sgd_step_sr(const TensorList& params, const TensorList& grads,
                 const TensorList& momentum_bufs, const at::Tensor& grad_scale,
                 const std::optional<at::Tensor>& found_inf, double lr, double weight_decay,
                 double momentum, double dampening, bool nesterov, bool maximize, bool first_run,
                 uint64_t seed, uint64_t step, const std::vector<int64_t>& tensor_ids);
// The Adam/AdamW counterpart (adam_update, as adam_step; same conventions as sgd_step_sr).
void adam_step_sr(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                  const TensorList& exp_avg_sqs, const at::Tensor& grad_scale,
                  const std::optional<at::Tensor>& found_inf, double lr, double beta1,
                  double beta2, double eps, double weight_decay, double bias_correction1,
                  double bias_correction2, bool decoupled, bool maximize, uint64_t seed,
                  uint64_t step, const std::vector<int64_t>& tensor_ids,
                  const std::optional<at::Tensor>& steps);

// The dynamic loss scale's update (step_math.h's update_scale_state) on the scaler's device
// tensors, one op: `state` 3 contiguous float64 numbers, `scale32` and `inv32` one fp32 number
// each (written from the new state). The verdict is `found_inf` when given (a one-element fp32
// flag, non-zero: overflow), else `found`; `when` (a one-element bool tensor), where false,
// leaves the state as it is. All on one device; on CUDA one thread, no host read.
void update_scale(const at::Tensor& state, const at::Tensor& scale32, const at::Tensor& inv32,
                  const std::optional<at::Tensor>& found_inf, bool found,
                  const std::optional<at::Tensor>& when, double growth_factor,
                  double backoff_factor, int64_t growth_interval, bool has_min, double min_scale,
                  double max_scale, int64_t hysteresis);

// update_scale's argument checks; returns the knobs as step_math.h's ScaleUpdate.
inline ScaleUpdate check_scale_update(const at::Tensor& state, const at::Tensor& scale32,
                                      const at::Tensor& inv32,
                                      const std::optional<at::Tensor>& found_inf,
                                      const std::optional<at::Tensor>& when, double growth_factor,
                                      double backoff_factor, int64_t growth_interval,
                                      bool has_min, double min_scale, double max_scale,
                                      int64_t hysteresis) {
  AMP_CHECK(state.scalar_type() == at::kDouble && state.numel() == 3 && state.is_contiguous(),
            "update_scale: state must be 3 contiguous float64 numbers, got ",
            state.scalar_type(), " with ", state.numel(), " elements");
  const at::Device device = state.device();
  check_scalar(scale32, "scale32", device);
  check_scalar(inv32, "inv32", device);
  if (found_inf.has_value() && found_inf->defined()) check_scalar(*found_inf, "found_inf", device);
  if (when.has_value() && when->defined()) {
    AMP_CHECK(when->numel() == 1 && when->scalar_type() == at::kBool,
              "update_scale: when must be a one-element bool tensor, got ", when->scalar_type(),
              " with ", when->numel(), " elements");
    AMP_CHECK(when->device() == device, "update_scale: when is on ", when->device(),
              ", the state on ", device);
  }
  ScaleUpdate u;
  u.growth_factor = growth_factor;
  u.backoff_factor = backoff_factor;
  u.growth_interval = static_cast<double>(growth_interval);
  u.min_scale = min_scale;
  u.max_scale = max_scale;
  u.hysteresis = static_cast<double>(hysteresis);
  u.has_min = has_min;
  return u;
}

inline AdamArgs make_adam_args(double lr, double beta1, double beta2, double eps,
                               double weight_decay, double bias_correction1,
                               double bias_correction2, bool decoupled) {
  AdamArgs a;
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.step_size = static_cast<float>(lr / bias_correction1);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  a.l2_weight_decay = decoupled ? 0.f : static_cast<float>(weight_decay);
  a.decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.f;
  return a;
}

// The per-param step numbers of an Adam step (see adam_step), checked, with the host's
// hyperparameters for the terms that follow from them; `steps` absent: none (AdamSteps{}).
inline AdamSteps adam_steps(const char* op, const std::optional<at::Tensor>& steps, size_t n,
                            const at::Device& device, double lr, double beta1, double beta2) {
  AdamSteps s;
  if (!steps.has_value() || !steps->defined()) return s;
  const at::Tensor& t = *steps;
  AMP_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(), op,
            ": steps must be a contiguous 1-D float32 tensor, got ", t.scalar_type(), " with ",
            t.dim(), " dimensions");
  AMP_CHECK(static_cast<size_t>(t.numel()) == n, op, ": steps has ", t.numel(),
            " numbers for ", n, " params");
  AMP_CHECK(t.device() == device, op, ": steps is on ", t.device(), ", the params on ", device);
  s.steps = t.data_ptr<float>();
  s.lr = lr;
  s.beta1 = beta1;
  s.beta2 = beta2;
  return s;
}

inline SgdArgs make_sgd_args(double lr, double weight_decay, double momentum, double dampening,
                             bool nesterov, bool first_run) {
  SgdArgs s;
  s.lr = static_cast<float>(lr);
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1.0 - dampening);
  s.nesterov = nesterov;
  s.first_run = first_run;
  return s;
}

// Argument checks shared by both backends' step functions.
inline void check_step_lists(const char* op, const TensorList& params, const TensorList& grads,
                             const TensorList& state_a, const TensorList& state_b,
                             bool state_b_used, const TensorList& model_copies) {
  check_lists(op, {&params, &grads, &state_a, &state_b, &model_copies},
              {"params", "grads", "state", "state2", "model_copies"},
              {false, false, !state_b_used, !state_b_used, true},
              {true, false, false, false, false});
  // the state in float32 or bfloat16 (precision.optimizer_state), both lists of one type
  for (size_t i = 0; i < state_a.size(); ++i) {
    const at::ScalarType t = state_a[i].scalar_type();
    AMP_CHECK(t == at::kFloat || t == at::kBFloat16, op, ": optimizer state [", i,
                "] must be float32 or bfloat16, got ", t);
    AMP_CHECK(state_b.size() <= i || state_b[i].scalar_type() == t, op,
                ": the two optimizer states of param ", i, " differ in type (",
                t, " and ", state_b[i].scalar_type(), ")");
  }
  for (size_t i = 0; i < model_copies.size(); ++i) {
    // an fp32 param that is the model's own parameter is passed as its own copy (not written)
    AMP_CHECK(model_copies[i].scalar_type() != at::kFloat ||
                    model_copies[i].data_ptr() == params[i].data_ptr(),
                op, ": model_copies[", i, "] is a float32 tensor other than params[", i,
                "]; a copy is the 16-bit model parameter, or the param itself for none");
  }
}

// The per-position keys of a stochastic-rounding op (after checking the ids).
inline std::vector<SrKey> sr_keys(const char* op, uint64_t seed, uint64_t step,
                                  const std::vector<int64_t>& tensor_ids, size_t n) {
  AMP_CHECK(tensor_ids.size() == n, op, ": tensor_ids has ", tensor_ids.size(),
              " ids for ", n, " tensors");
  std::vector<SrKey> keys;
  keys.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = tensor_ids[i];
    AMP_CHECK(id >= 0 && id <= 0xFFFFFFFFll, op, ": tensor_ids[", i, "] = ", id,
                " is outside [0, 2^32)");
    keys.push_back(sr_key(seed, step, static_cast<uint32_t>(id)));
  }
  return keys;
}

inline void check_sr_round_lists(const TensorList& src, const TensorList& dst) {
  check_lists("stochastic_round", {&src, &dst}, {"src", "dst"}, {false, false}, {true, false});
  for (size_t i = 0; i < dst.size(); ++i) {
    AMP_CHECK(dst[i].scalar_type() == at::kBFloat16, "stochastic_round: dst[", i,
                "] must be bfloat16, got ", dst[i].scalar_type());
  }
}

// Argument checks of the stochastic-rounding steps: bf16 params, state bf16 or fp32.
inline void check_sr_step_lists(const char* op, const TensorList& params, const TensorList& grads,
                                const TensorList& state_a, const TensorList& state_b,
                                bool state_a_used, bool state_b_used) {
  check_lists(op, {&params, &grads, &state_a, &state_b}, {"params", "grads", "state", "state2"},
              {false, false, !state_a_used, !state_b_used}, {false, false, false, false});
  for (size_t i = 0; i < params.size(); ++i) {
    AMP_CHECK(params[i].scalar_type() == at::kBFloat16, op, ": params[", i,
                "] must be bfloat16 (stochastic rounding writes bf16 weights), got ",
                params[i].scalar_type());
  }
  for (const TensorList* list : {&state_a, &state_b}) {
    for (size_t i = 0; i < list->size(); ++i) {
      const at::ScalarType t = (*list)[i].scalar_type();
      AMP_CHECK(t == at::kBFloat16 || t == at::kFloat, op, ": optimizer state [", i,
                  "] must be bfloat16 or float32, got ", t);
    }
  }
}

}  // namespace amp_runner

// Both backends expose the same Python API.
#define AMP_RUNNER_BIND_OPS(m, ns, backend_name)                                                  \
  m.attr("backend") = backend_name;                                                              \
  m.def("unscale_check", &ns::unscale_check, "out = grads * inv_scale; flag inf/NaN",            \
        pybind11::arg("grads"), pybind11::arg("out"), pybind11::arg("inv_scale"),                \
        pybind11::arg("found_inf"));                                                             \
  m.def("check_finite", &ns::check_finite, "flag inf/NaN (read-only)", pybind11::arg("tensors"), \
        pybind11::arg("found_inf"));                                                             \
  m.def("l2norm", &ns::l2norm, "(total, per-tensor) L2 norms of scale * tensors",                \
        pybind11::arg("tensors"), pybind11::arg("scale"),                                        \
        pybind11::arg("found_inf") = pybind11::none());                                          \
  m.def("copy_scale", &ns::copy_scale, "dst = src * scale", pybind11::arg("src"),                \
        pybind11::arg("dst"), pybind11::arg("scale"));                                           \
  m.def("sgd_step", &ns::sgd_step, "fused SGD step on fp32 params", pybind11::arg("params"),     \
        pybind11::arg("grads"), pybind11::arg("momentum_bufs"), pybind11::arg("model_copies"),   \
        pybind11::arg("grad_scale"), pybind11::arg("found_inf"), pybind11::arg("lr"),            \
        pybind11::arg("weight_decay"), pybind11::arg("momentum"), pybind11::arg("dampening"),    \
        pybind11::arg("nesterov"), pybind11::arg("maximize"), pybind11::arg("first_run"),        \
        pybind11::arg("lr_tensor") = pybind11::none());                                          \
  m.def("adam_step", &ns::adam_step, "fused Adam/AdamW step on fp32 params",                     \
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avgs"),              \
        pybind11::arg("exp_avg_sqs"), pybind11::arg("model_copies"), pybind11::arg("grad_scale"),\
        pybind11::arg("found_inf"), pybind11::arg("lr"), pybind11::arg("beta1"),                 \
        pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"),             \
        pybind11::arg("bias_correction1"), pybind11::arg("bias_correction2"),                    \
        pybind11::arg("decoupled"), pybind11::arg("maximize"),                                   \
        pybind11::arg("steps") = pybind11::none(),                                               \
        pybind11::arg("lr_tensor") = pybind11::none());                                          \
  m.def("stochastic_round", &ns::stochastic_round, "dst = bf16(src), rounded stochastically",   \
        pybind11::arg("src"), pybind11::arg("dst"), pybind11::arg("seed"), pybind11::arg("step"),\
        pybind11::arg("tensor_ids"));                                                            \
  m.def("sgd_step_sr", &ns::sgd_step_sr,                                                         \
        "fused SGD step on bf16 params, stored stochastically rounded",                          \
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("momentum_bufs"),         \
        pybind11::arg("grad_scale"), pybind11::arg("found_inf"), pybind11::arg("lr"),            \
        pybind11::arg("weight_decay"), pybind11::arg("momentum"), pybind11::arg("dampening"),    \
        pybind11::arg("nesterov"), pybind11::arg("maximize"), pybind11::arg("first_run"),        \
        pybind11::arg("seed"), pybind11::arg("step"), pybind11::arg("tensor_ids"));              \
  m.def("adam_step_sr", &ns::adam_step_sr,                                                       \
        "fused Adam/AdamW step on bf16 params, stored stochastically rounded",                   \
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avgs"),              \
        pybind11::arg("exp_avg_sqs"), pybind11::arg("grad_scale"), pybind11::arg("found_inf"),   \
        pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"),\
        pybind11::arg("weight_decay"), pybind11::arg("bias_correction1"),                        \
        pybind11::arg("bias_correction2"), pybind11::arg("decoupled"), pybind11::arg("maximize"),\
        pybind11::arg("seed"), pybind11::arg("step"), pybind11::arg("tensor_ids"),               \
        pybind11::arg("steps") = pybind11::none());                                      \
  m.def("update_scale", &ns::update_scale,                                                       \
        "the dynamic loss scale's update on its device state, one op",                          \
        pybind11::arg("state"), pybind11::arg("scale32"), pybind11::arg("inv32"),                \
        pybind11::arg("found_inf"), pybind11::arg("found"), pybind11::arg("when"),               \
        pybind11::arg("growth_factor"), pybind11::arg("backoff_factor"),                         \
        pybind11::arg("growth_interval"), pybind11::arg("has_min"), pybind11::arg("min_scale"),  \
        pybind11::arg("max_scale"), pybind11::arg("hysteresis"))
