// Fused Adam / AdamW over flat CPU chunks, and the streaming kernel that measures its memory bound.
//
// Why a kernel of our own: on the host tier the optimizer step is memory bound. torch's fused CPU
// AdamW already moves the minimum for fp32 (p, g, m, v read; p, m, v written: 28 bytes/param), but
// a mixed-precision step with torch needs extra passes (bf16 grad -> fp32, then fp32 param ->
// bf16 copy). adam_step does it in one pass: low-precision grad in, fp32 master/m/v updated, the
// low-precision param written while the master is still in registers.
//
// Contract of adam_step (checked; violations raise ValueError / TypeError from Python):
//  - param (fp32 master or plain fp32 param), exp_avg, exp_avg_sq: fp32; grad: fp32, bf16 or fp16;
//    param_out (optional): bf16 or fp16. All on the CPU, contiguous, with the same numel.
//    param, exp_avg, exp_avg_sq (and param_out) are updated in place; grad is only read.
//  - The arithmetic is torch's single-tensor Adam (torch.optim.Adam/AdamW, CPU, default options)
//    op for op, each op rounded to float32 as torch's CPU kernels round it, so results are
//    bit-identical to torch's for every code path and every thread count:
//      g  = float(grad) * grad_scale          (only when grad_scale != 1)
//      AdamW: p = p * f(1 - lr*wd)            Adam (L2): g = fma(p, f(wd), g)   (if wd != 0)
//      m  = lerp(m, g, f(1 - beta1))          torch's lerp: w < 0.5 ? fma(w, g-m, m)
//                                                                   : fma(w-1, g-m, g)
//      v  = fma(f(1-beta2) * g, g, v * f(beta2))
//    (each fma is fused where torch's CPU kernels fuse it -- its AVX2 / AVX-512 builds -- and a
//    rounded multiply then add where they do not, e.g. at torch's DEFAULT capability)
//      d  = sqrt(v) / f(sqrt(1 - beta2^step)) + f(eps)     (sqrt: see below)
//      p  = p + (f(-lr / (1 - beta1^step)) * m) / d
//    where f() rounds a double hyper-parameter to float as torch's Scalar conversion does, and
//    sqrt is the one torch's Tensor.sqrt uses on this build (sqrt="torch": MKL's vmsSqrt, which
//    is not correctly rounded, where torch has MKL; IEEE sqrt otherwise) or IEEE sqrt
//    (sqrt="ieee": faster, one pass; equal to torch's fused=True CPU AdamW up to 1 ulp in v).
//  - param_out = round-to-nearest-even(p) in bf16/fp16; a NaN stays a (quiet) NaN with its sign.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace hetero {

// Code paths of the CPU kernels, chosen at run time (never by build flags).
enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(CpuIsa isa);
// Whether this CPU (and OS) can run the path: AVX-512 F+BW; AVX2 with FMA and F16C.
bool isa_supported(CpuIsa isa);
// Supported paths, best first (the scalar path is always last).
std::vector<std::string> available_isas();
// Path for a request: "" or "auto" means the environment variable HETERO_ADAM_ISA if set and
// non-empty, else the best supported path. Throws std::invalid_argument for an unknown name or a
// path this CPU cannot run.
CpuIsa resolve_isa(const std::string& requested);

// Hyper-parameters as torch's Adam receives them (Python floats, integer step >= 1).
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = false;  // AdamW: decay the weights instead of adding wd * p to the gradient
  int64_t step = 1;        // the step count after this update (torch's state["step"] + 1)
  double grad_scale = 1.0; // multiplies the gradient before use (clipping, loss scaling)
};

// One Adam(W) update in place (see the contract above). threads <= 0 means at::get_num_threads();
// sqrt is "torch" or "ieee". Runs without the GIL from Python; the tensors must not be resized
// concurrently.
void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
               const AdamHyper& hyper, const std::string& isa, int64_t threads,
               const std::string& sqrt);

// adam_step in two halves, for updates run later on another thread (adam_queue.h): prepare checks
// the arguments as adam_step does (throwing the same errors) and resolves the code path, thread
// count (threads <= 0: this thread's at::get_num_threads()) and constants; the result holds raw
// pointers into the tensors, not references, so that no tensor is released off the caller's
// thread (releasing one can need the GIL). The caller keeps the tensors alive, and leaves them
// alone, until run_prepared_adam returned.
struct PreparedAdam;
std::shared_ptr<const PreparedAdam> prepare_adam_step(
    const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
    const AdamHyper& hyper, const std::string& isa, int64_t threads, const std::string& sqrt);
void run_prepared_adam(const PreparedAdam& prepared);

// How torch's own kernels round in this process (measured once against torch): the square root
// sqrt="torch" resolves to ("mkl" or "ieee"), and whether add/lerp/addcmul fuse multiply-adds.
std::string torch_sqrt();
bool torch_uses_fma();

// Memory-bandwidth probe with the access pattern of an update kernel: every element of the fp32
// tensors in `read` is read, every element of those in `update` is read and written back
// (u[i] += scale * sum of read[k][i]; scale = 0 leaves finite values as they were, but for the
// sign of a zero, yet still writes every line). All contiguous CPU fp32 tensors of one numel. With
// read = {g} and update = {p, m, v} it moves exactly the bytes of an fp32 Adam step without its
// arithmetic, on the same threads and with the same software prefetch as the Adam kernel.
// Returns the bytes moved: numel * 4 * (len(read) + 2 * len(update)).
int64_t stream_update(const std::vector<at::Tensor>& read, const std::vector<at::Tensor>& update,
                      double scale, const std::string& isa, int64_t threads);

}  // namespace hetero
