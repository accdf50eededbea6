// Registers the CPU Adam kernel's functions (adam_step, adam_torch_numerics, adam_isas, adam_isa,
// stream_update) on a Python module: hetero._C, and the test build with the AVX-512 path emulated.
#pragma once

#include <pybind11/pybind11.h>

#include "cpu_adam.h"

namespace hetero {

void bind_cpu_adam(pybind11::module_& m);

// adam_step's hyper-parameters in the order its binding (and the Adam queue's submit) takes them.
AdamHyper adam_hyper(int64_t step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, double grad_scale);

}  // namespace hetero
