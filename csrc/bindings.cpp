// Python bindings of hetero._C. Errors map to: IOFailure -> OSError(errno, message),
// std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError.
#include <torch/extension.h>

#include "aio.h"

namespace py = pybind11;
using hetero::IOEngine;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hetero native runtime: swap-file I/O engine of the NVMe tier";
  m.attr("DIRECT_ALIGNMENT") = hetero::kDirectAlignment;

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hetero::IOFailure& e) {
      py::tuple args = py::make_tuple(e.err, e.what());
      PyErr_SetObject(PyExc_OSError, args.ptr());
    }
  });

  auto submit = [](bool write) {
    return [write](IOEngine& e, int fd, const at::Tensor& t, int64_t offset,
                   const std::string& fault) {
      return e.submit(write, fd, t, offset, hetero::parse_fault(fault));
    };
  };

  py::class_<IOEngine>(m, "IOEngine",
                       "Fixed pool of worker threads doing positional swap-file I/O.")
      .def(py::init<int>(), py::arg("num_threads"))
      .def("open", &IOEngine::open, py::arg("path"), py::arg("size"), py::arg("direct"),
           "Open/create (mode 0600) and grow to size; -1 if direct and the fs rejects O_DIRECT.")
      .def("close", &IOEngine::close, py::arg("fd"))
      .def("submit_write", submit(true), py::arg("fd"), py::arg("tensor"), py::arg("offset"),
           py::arg("fault") = "none", "Queue a pwrite of all of tensor's bytes; returns a handle.")
      .def("submit_read", submit(false), py::arg("fd"), py::arg("tensor"), py::arg("offset"),
           py::arg("fault") = "none", "Queue a pread into all of tensor's bytes; returns a handle.")
      .def("wait", &IOEngine::wait, py::arg("handle"), py::call_guard<py::gil_scoped_release>(),
           "Block (GIL released) until done; OSError on failure. Each handle is waited once.")
      .def("poll", &IOEngine::poll, py::arg("handle"))
      .def("shutdown", &IOEngine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_threads", &IOEngine::num_threads);
}
