"""Builds the native extension ``hetero._C`` against the installed torch.

Install with ``pip install --no-build-isolation -e .``. A compile error fails the install: the
pure-Python I/O fallback in ``hetero.engine`` only covers running from a source tree that was
never built. The extension is a CUDAExtension when torch has CUDA and a toolkit is found (so
``csrc/*.cu`` files are compiled once they exist), otherwise a CppExtension over ``csrc/*.cpp``.
The ``-std`` flag is left to BuildExtension, which adds the one the installed torch's headers
need (c++17 on older torch, c++20 on current torch); our own sources are plain C++17.

``-ffp-contract=off`` keeps the compiler from fusing a multiply and an add into an fma on its own
(GCC does so by default, intrinsics included): the CPU Adam kernel (``csrc/cpu_adam.cpp``) rounds
each operation exactly where torch does, to be bit-identical to ``torch.optim.Adam``. Its SIMD code
paths are selected at run time and compiled with per-function ``target`` attributes, so no
``-march``/``-mavx*`` flag is needed and the extension builds and runs on any x86-64 CPU (other
architectures get its portable path).

``-fopenmp`` (Linux, when torch's parallel backend is OpenMP): the kernel runs on torch's own
thread pool through ``at::parallel_for``, whose OpenMP implementation is inline in torch's headers
and silently runs serially in code compiled without it. The extension then needs ``libgomp.so.1``,
the OpenMP runtime torch itself loads, so the process keeps a single runtime.

The C++ runtime: the extension must use the ``libstdc++.so`` the process (torch) already loaded.
A compiler whose toolchain has only a static ``libstdc++.a`` embeds a second copy of the C++
runtime in ``_C.so``; the two copies' locale facets clash, and the first number formatted into an
error message (``TORCH_CHECK``, ``std::ostringstream``) crashes with SIGSEGV. That is what the
GPU machine's build did: its environment sets ``CXX=/opt/gcc/bin/g++``, such a toolchain. So a
probe links a tiny shared object with the compiler the build would use (``CXX``, else Python's
configured one), and where it does not need ``libstdc++.so``, the build switches to ``c++`` /
``g++`` on ``PATH`` when those do (and says so).

liburing: when a test program including ``<liburing.h>`` compiles and links with ``-luring``
(Debian: ``apt-get install liburing-dev``), the swap I/O engine gets its io_uring backend
(``-DHETERO_HAVE_LIBURING``, linked against ``liburing``). Without it the extension still builds
and the engine runs its thread-pool backend only. ``HETERO_NO_LIBURING=1`` skips the probe.
"""

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parent
CXX_FLAGS = ["-O3", "-ffp-contract=off"]
LINK_FLAGS: list[str] = []
if sys.platform.startswith("linux") and "parallel backend: OpenMP" in torch.__config__.parallel_info():
    CXX_FLAGS.append("-fopenmp")
    LINK_FLAGS.append("-fopenmp")


@contextlib.contextmanager
def probe_build(compiler: list[str], filename: str, source: str, args: list[str]) -> Iterator[Path | None]:
    """Build ``source`` (saved as ``filename``) with ``compiler`` and ``args`` in a temporary
    directory: the output, while the directory lasts, or None where it did not build."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, filename), Path(tmp, "probe.out")
        src.write_text(source)
        try:
            done = subprocess.run([*compiler, str(src), "-o", str(out), *args], capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            done = None
        yield out if done is not None and done.returncode == 0 else None


def have_liburing() -> bool:
    """Whether a program using liburing compiles and links here (headers and library present)."""
    if os.environ.get("HETERO_NO_LIBURING", "") not in ("", "0"):
        return False
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    source = "#include <liburing.h>\nint main(void) { struct io_uring r; return io_uring_queue_init(2, &r, 0); }\n"
    with probe_build(cc, "uring_check.c", source, ["-luring"]) as built:
        return built is not None


def needs_shared_cxx_runtime(cxx: list[str]) -> bool | None:
    """Whether a shared object linked by the C++ compiler ``cxx`` needs ``libstdc++.so``
    (None: the probe could not tell: no compiler, no ``readelf``)."""
    source = ("#include <sstream>\n#include <string>\n"
              "std::string probe(long x) { std::ostringstream s; s << x; return s.str(); }\n")
    with probe_build(cxx, "probe.cpp", source, ["-shared", "-fPIC"]) as lib:
        if lib is None:
            return None
        try:
            dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
    return "libstdc++" in dynamic.stdout if dynamic.returncode == 0 else None


def use_a_shared_cxx_runtime() -> None:
    """See the module docstring: switch CXX/CC to a compiler on PATH that links libstdc++.so when
    the one the build would use (``CXX``, else Python's configured one) embeds a static copy."""
    if not sys.platform.startswith("linux"):
        return
    configured = shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")
    if needs_shared_cxx_runtime(configured) is not False:
        return
    for cxx, cc in (("c++", "cc"), ("g++", "gcc")):
        cxx_path, cc_path = shutil.which(cxx), shutil.which(cc)
        if cxx_path and cc_path and needs_shared_cxx_runtime([cxx_path]):
            os.environ["CXX"], os.environ["CC"] = cxx_path, cc_path
            print(f"hetero: {' '.join(configured)} links the C++ runtime statically, which crashes "
                  f"next to torch's libstdc++.so; building with CXX={cxx_path} CC={cc_path}",
                  file=sys.stderr)
            return
    print(f"hetero: WARNING: {' '.join(configured)} links the C++ runtime statically and no compiler "
          "on PATH links libstdc++.so; hetero._C may crash formatting error messages. Set CXX/CC to "
          "a compiler with a shared libstdc++.", file=sys.stderr)


use_a_shared_cxx_runtime()

MACROS: list[tuple[str, str | None]] = []
LIBRARIES: list[str] = []
if sys.platform.startswith("linux") and have_liburing():
    MACROS.append(("HETERO_HAVE_LIBURING", None))
    LIBRARIES.append("uring")
    print("hetero: building the io_uring I/O backend (liburing found)", file=sys.stderr)
else:
    print("hetero: liburing not found (apt-get install liburing-dev); the I/O engine gets its "
          "thread-pool backend only", file=sys.stderr)

USE_CUDA = (torch.cuda.is_available() or torch.version.cuda is not None) and (
    cpp_extension.CUDA_HOME is not None
)
SOURCES = sorted(
    str(p.relative_to(ROOT))
    for pattern in (("*.cpp", "*.cu") if USE_CUDA else ("*.cpp",))
    for p in (ROOT / "csrc").glob(pattern)
)

if USE_CUDA:
    # HETERO_CUDA compiles the CUDA path of the copy engine (csrc/copy.cpp): streams and events.
    ext = cpp_extension.CUDAExtension(
        "hetero._C", SOURCES,
        extra_compile_args={"cxx": [*CXX_FLAGS, "-DHETERO_CUDA"],
                            "nvcc": ["-O3", "-DHETERO_CUDA"]},
        extra_link_args=LINK_FLAGS, define_macros=MACROS, libraries=LIBRARIES,
    )
else:
    ext = cpp_extension.CppExtension(
        "hetero._C", SOURCES, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=LINK_FLAGS,
        define_macros=MACROS, libraries=LIBRARIES,
    )

setup(ext_modules=[ext], cmdclass={"build_ext": cpp_extension.BuildExtension})
