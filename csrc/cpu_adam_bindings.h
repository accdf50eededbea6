// Registers the CPU Adam kernel's functions (adam_step, adam_torch_numerics, adam_isas, adam_isa,
// stream_update) on a Python module: hetero._C, and the test build with the AVX-512 path emulated.
#pragma once

#include <pybind11/pybind11.h>

namespace hetero {

void bind_cpu_adam(pybind11::module_& m);

}  // namespace hetero
