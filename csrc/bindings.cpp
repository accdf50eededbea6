// Python bindings of hetero._C. Errors map to: IOFailure -> OSError(errno, message),
// std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError (TORCH_CHECK_VALUE /
// TORCH_CHECK_TYPE in the CPU Adam kernel -> ValueError / TypeError).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "adam_queue.h"
#include "aio.h"
#include "copy.h"
#include "cpu_adam_bindings.h"

namespace py = pybind11;
using hetero::IOEngine;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hetero native runtime: swap-file I/O engine of the NVMe tier, fused CPU Adam";
  // hetero/native.py refuses a build whose INTERFACE differs from its own: raise both together
  // whenever a binding changes incompatibly.
  m.attr("INTERFACE") = 2;
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
                       "Swap-file I/O engine: whole-tensor requests split into block_size "
                       "sub-requests, queue_depth of them in flight, on io_uring or a thread pool.")
      .def(py::init<int, const std::string&, int64_t, int, bool>(), py::arg("num_threads"),
           py::arg("backend") = "auto", py::arg("block_size") = int64_t(1) << 20,
           py::arg("queue_depth") = 32, py::arg("checksum") = false,
           "backend 'auto' | 'io_uring' | 'threads' (OSError if io_uring is asked for and "
           "unavailable); the threads backend runs max(num_threads, queue_depth) workers.")
      .def(
          "open",
          [](IOEngine& e, const std::string& path, int64_t size, bool direct, bool preallocate) {
            std::string note;
            int fd;
            {
              py::gil_scoped_release nogil;  // fallocate of a large file takes a while
              fd = e.open(path, size, direct, preallocate, &note);
            }
            if (!note.empty())
              py::module_::import("logging").attr("getLogger")("hetero.engine")
                  .attr("warning")("%s: %s", path, note);
            return fd;
          },
          py::arg("path"), py::arg("size"), py::arg("direct"), py::arg("preallocate") = true,
          "Open/create (mode 0600), reserve (fallocate) and grow to size; OSError(ENOSPC) when "
          "the space is not there; -1 if direct and the fs rejects O_DIRECT.")
      .def("close", &IOEngine::close, py::arg("fd"))
      .def("submit_write", submit(true), py::arg("fd"), py::arg("tensor"), py::arg("offset"),
           py::arg("fault") = "none", "Queue a pwrite of all of tensor's bytes; returns a handle.")
      .def("submit_read", submit(false), py::arg("fd"), py::arg("tensor"), py::arg("offset"),
           py::arg("fault") = "none", "Queue a pread into all of tensor's bytes; returns a handle.")
      .def("wait", &IOEngine::wait, py::arg("handle"), py::call_guard<py::gil_scoped_release>(),
           "Block (GIL released) until done; OSError on failure. Each handle is waited once.")
      .def("wait_for", &IOEngine::wait_for, py::arg("handle"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>(),
           "As wait, but False (handle kept) if not done within timeout seconds.")
      .def("poll", &IOEngine::poll, py::arg("handle"))
      .def("shutdown", &IOEngine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("set_tuning", &IOEngine::set_tuning, py::arg("block_size"), py::arg("queue_depth"),
           "Sub-request size and chunks in flight for requests submitted from now on.")
      .def_property_readonly("backend", &IOEngine::backend)
      .def_property_readonly("backend_note", &IOEngine::backend_note)
      .def_property_readonly("num_threads", &IOEngine::num_threads)
      .def_property_readonly("block_size", &IOEngine::block_size)
      .def_property_readonly("queue_depth", &IOEngine::queue_depth)
      .def_property_readonly("checksum", &IOEngine::checksum);
  m.attr("MAX_QUEUE_DEPTH") = hetero::kMaxQueueDepth;
  m.attr("MAX_BLOCK_SIZE") = hetero::kMaxBlockSize;
  m.def(
      "io_uring_available",
      []() {
        std::string why;
        bool ok = hetero::io_uring_available(&why);
        return py::make_tuple(ok, why);
      },
      "(available, reason if not): whether this build and kernel can create an io_uring ring.");
  m.def(
      "crc32c",
      [](const at::Tensor& t, uint32_t crc) {
        TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous(),
                          "crc32c needs a contiguous CPU tensor");
        const void* p = t.data_ptr();
        size_t n = t.nbytes();
        py::gil_scoped_release nogil;
        return hetero::crc32c(p, n, crc);
      },
      py::arg("tensor"), py::arg("crc") = 0,
      "CRC32C of the tensor's bytes (continuing from crc), as the engine's checksums compute it.");

  // ---- Copy engine (csrc/copy.h); hetero.copies is the Python face.
  m.attr("COPY_CUDA") = hetero::CopyEngine::has_cuda();
  m.def("pinned_empty", &hetero::pinned_empty, py::arg("nbytes"),
        "uint8 CPU tensor of nbytes, page-aligned and page-locked with cudaHostRegister (exactly "
        "those bytes, released when the tensor's storage is freed); needs a HETERO_CUDA build.");
  py::class_<hetero::CopyHandle>(m, "CopyHandle", "One queued copy of a CopyEngine.")
      .def("wait", &hetero::CopyHandle::wait, py::call_guard<py::gil_scoped_release>(),
           "Block (GIL released) until the copy is complete; RuntimeError if it failed.")
      .def("done", &hetero::CopyHandle::done, "Whether the copy is complete; never blocks.")
      .def("wait_on_stream", &hetero::CopyHandle::wait_on_stream, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "Make a CUDA stream (cudaStream_t as int) wait for the copy on the GPU.")
      .def_property_readonly("nbytes", &hetero::CopyHandle::nbytes)
      .def_property_readonly("kind", &hetero::CopyHandle::kind);
  py::class_<hetero::CopyEngine>(m, "CopyEngine",
                                 "Asynchronous host/device tensor copies: worker threads for "
                                 "host copies, dedicated CUDA streams for device copies.")
      .def(py::init<int, int64_t>(), py::arg("num_threads") = 2, py::arg("inline_bytes") = -1)
      .def("copy", &hetero::CopyEngine::copy, py::arg("dst"), py::arg("src"), py::kw_only(),
           py::arg("after_stream") = py::none(), py::call_guard<py::gil_scoped_release>(),
           "Queue dst <- src (contiguous, same dtype and numel); returns a CopyHandle at once.")
      .def("shutdown", &hetero::CopyEngine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_threads", &hetero::CopyEngine::num_threads);

  // ---- CPU Adam (csrc/cpu_adam_bindings.cpp); hetero.optim.kernel is the Python face.
  hetero::bind_cpu_adam(m);

  // ---- Adam queue (csrc/adam_queue.h); hetero.optim.queue.AdamQueue is the Python face.
  py::class_<hetero::AdamJob>(m, "AdamJob", "One queued job of an AdamQueue.")
      .def("wait", &hetero::AdamJob::wait, py::call_guard<py::gil_scoped_release>(),
           "Block (GIL released) until the job ran; raises what it raised, at every wait.")
      .def("done", &hetero::AdamJob::done, "Whether the job ran (or failed); never blocks.");
  py::class_<hetero::AdamQueue>(m, "AdamQueue",
                                "Runs adam_step calls on a thread of its own (no GIL), in order.")
      .def(py::init<>())
      .def(
          "submit",
          [](hetero::AdamQueue& q, const py::list& calls) {
            std::vector<hetero::AdamCall> parsed;
            parsed.reserve(calls.size());
            for (const py::handle& item : calls) {
              const auto t = item.cast<py::tuple>();
              if (t.size() != 16)
                throw py::value_error("each call is adam_step's arguments in order (param, grad, "
                                      "exp_avg, exp_avg_sq, param_out, step, lr, beta1, beta2, "
                                      "eps, weight_decay, decoupled, grad_scale, isa, threads, sqrt)");
              std::optional<at::Tensor> out;
              if (!t[4].is_none()) out = t[4].cast<at::Tensor>();
              const hetero::AdamHyper h = hetero::adam_hyper(
                  t[5].cast<int64_t>(), t[6].cast<double>(), t[7].cast<double>(),
                  t[8].cast<double>(), t[9].cast<double>(), t[10].cast<double>(),
                  t[11].cast<bool>(), t[12].cast<double>());
              parsed.push_back(hetero::prepare_adam_step(
                  t[0].cast<at::Tensor>(), t[1].cast<at::Tensor>(), t[2].cast<at::Tensor>(),
                  t[3].cast<at::Tensor>(), out, h, t[13].cast<std::string>(),
                  t[14].cast<int64_t>(), t[15].cast<std::string>()));
            }
            py::gil_scoped_release nogil;
            return q.submit(std::move(parsed));
          },
          py::arg("calls"),
          "Queue one job (a list of adam_step argument tuples, checked now); an AdamJob. The "
          "caller keeps the tensors alive until it is done.")
      .def("shutdown", &hetero::AdamQueue::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Run what is queued, then stop the thread.")
      .def("set_test_hook", &hetero::AdamQueue::set_test_hook, py::arg("delay_s"),
           py::arg("fail_call"), "Tests only: slow every call down, fail one (see adam_queue.h).")
      .def_property_readonly("calls", &hetero::AdamQueue::calls);
}
