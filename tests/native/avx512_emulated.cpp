// The test module of tests/test_cpu_adam.py: csrc/cpu_adam.cpp built with -DHETERO_EMULATE_AVX512
// (its AVX-512 path on tests/native/avx512_emulation.h), with hetero._C's Adam functions.
#include <torch/extension.h>

#include "cpu_adam_bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { hetero::bind_cpu_adam(m); }
