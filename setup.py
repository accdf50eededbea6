"""Builds the native extension ``hetero._C`` against the installed torch.

Install with ``pip install --no-build-isolation -e .``. A compile error fails the install: the
pure-Python I/O fallback in ``hetero.engine`` only covers running from a source tree that was
never built. The extension is a CUDAExtension when torch has CUDA and a toolkit is found (so
``csrc/*.cu`` files are compiled once they exist), otherwise a CppExtension over ``csrc/*.cpp``.
The ``-std`` flag is left to BuildExtension, which adds the one the installed torch's headers
need (c++17 on older torch, c++20 on current torch); our own sources are plain C++17.
"""

from pathlib import Path

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parent
USE_CUDA = (torch.cuda.is_available() or torch.version.cuda is not None) and (
    cpp_extension.CUDA_HOME is not None
)
SOURCES = sorted(
    str(p.relative_to(ROOT))
    for pattern in (("*.cpp", "*.cu") if USE_CUDA else ("*.cpp",))
    for p in (ROOT / "csrc").glob(pattern)
)

if USE_CUDA:
    ext = cpp_extension.CUDAExtension(
        "hetero._C", SOURCES, extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]}
    )
else:
    ext = cpp_extension.CppExtension("hetero._C", SOURCES, extra_compile_args={"cxx": ["-O3"]})

setup(ext_modules=[ext], cmdclass={"build_ext": cpp_extension.BuildExtension})
