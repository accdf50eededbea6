// Python bindings of the CPU Adam kernel (csrc/cpu_adam.h), shared by hetero._C and the test
// build of tests/test_cpu_adam.py that runs the AVX-512 path emulated. hetero.optim.kernel is the
// Python face. TORCH_CHECK_VALUE / TORCH_CHECK_TYPE in the kernel surface as ValueError /
// TypeError, std::invalid_argument as ValueError.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "cpu_adam.h"
#include "cpu_adam_bindings.h"

namespace py = pybind11;

namespace hetero {

AdamHyper adam_hyper(int64_t step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, double grad_scale) {
  AdamHyper h;
  h.step = step;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.decoupled = decoupled;
  h.grad_scale = grad_scale;
  return h;
}

void bind_cpu_adam(py::module_& m) {
  m.def(
      "adam_step",
      [](const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
         const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, int64_t step,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
         double grad_scale, const std::string& isa, int64_t threads, const std::string& sqrt) {
        hetero::adam_step(param, grad, exp_avg, exp_avg_sq, param_out,
                          adam_hyper(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale),
                          isa, threads, sqrt);
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_out"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"), py::arg("grad_scale") = 1.0,
      py::arg("isa") = "", py::arg("threads") = 0, py::arg("sqrt") = "torch",
      py::call_guard<py::gil_scoped_release>(),
      "Fused Adam(W) update of flat CPU chunks in place, bit-identical to torch's single-tensor "
      "Adam; isa '' = HETERO_ADAM_ISA or the best path; threads <= 0 = torch.get_num_threads(); "
      "sqrt 'torch' (torch's own square root) or 'ieee'.");
  m.def(
      "adam_torch_numerics",
      []() {
        std::string sqrt;
        bool fma;
        {
          py::gil_scoped_release nogil;  // runs torch ops once to measure them
          sqrt = hetero::torch_sqrt();
          fma = hetero::torch_uses_fma();
        }
        py::dict d;
        d["sqrt"] = sqrt;
        d["fma"] = fma;
        return d;
      },
      "How torch's CPU kernels round here, which the kernel mirrors: {'sqrt': 'mkl'|'ieee', "
      "'fma': bool}.");
  m.def("adam_isas", &hetero::available_isas,
        "Code paths of the CPU Adam kernel this CPU runs, best first.");
  m.def(
      "adam_isa",
      [](const std::string& isa) {
        return std::string(hetero::isa_name(hetero::resolve_isa(isa)));
      },
      py::arg("isa") = "", "The code path a call with this isa argument would take.");
  m.def("stream_update", &hetero::stream_update, py::arg("read"), py::arg("update"),
        py::arg("scale") = 1.0, py::arg("isa") = "", py::arg("threads") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "Bandwidth probe: u += scale * sum(read) for each u in update; returns the bytes moved.");
}

}  // namespace hetero
