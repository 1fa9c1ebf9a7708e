// The one file that knows Python: it releases the GIL around every call that can block and turns
// the engine's errors into OSError subclasses that carry errno and the file name. The CPU matmul
// kernels take tensors as addresses and sizes (zerolite.quant.cpu_kernels checks them): a call
// costs no conversion, where a decode step makes hundreds.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "cpu_matmul.h"
#include "io_engine.h"
#include "kv_decode.h"

namespace nb = nanobind;
using namespace nb::literals;
using zerolite::EngineOptions;
using zerolite::IoEngine;

namespace {

PyObject* short_read_error_type = nullptr;

void raise_os_error(PyObject* type, const zerolite::IoError& e) {
  PyObject* args = Py_BuildValue("(iss)", e.error_number(), e.what(), e.path().c_str());
  PyErr_SetObject(type, args);
  Py_XDECREF(args);
}

// Rows of x and y at these addresses: fp32, or bf16 where bf16_rows.
zerolite::Rows rows_of(std::uintptr_t x, std::int64_t rows, std::int64_t x_stride, std::uintptr_t y,
                       std::int64_t y_stride, bool bf16_rows) {
  if (!bf16_rows)
    return zerolite::Rows{reinterpret_cast<const float*>(x), rows, x_stride, reinterpret_cast<float*>(y), y_stride};
  return zerolite::Rows{nullptr, rows, x_stride, nullptr, y_stride, reinterpret_cast<const std::uint16_t*>(x),
                        reinterpret_cast<std::uint16_t*>(y)};
}

}  // namespace

NB_MODULE(_engine, m) {
  m.doc() = "zerolite's asynchronous O_DIRECT file reader (io_uring or a pread thread pool).";

  short_read_error_type = PyErr_NewExceptionWithDoc(
      "zerolite._engine.ShortReadError",
      "The file ended before all the bytes asked for were read (truncated, or read past its end).",
      PyExc_OSError, nullptr);
  m.attr("ShortReadError") = nb::handle(short_read_error_type);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const zerolite::ShortReadError& e) {
      raise_os_error(short_read_error_type, e);
    } catch (const zerolite::IoError& e) {
      raise_os_error(PyExc_OSError, e);
    }
  });

  nb::class_<IoEngine>(m, "Engine")
      .def(
          "__init__",
          [](IoEngine* self, const std::string& backend, unsigned queue_depth,
             std::size_t chunk_bytes, unsigned threads, const std::string& fault,
             std::uint64_t fault_at) {
            EngineOptions options;
            options.backend = backend;
            options.queue_depth = queue_depth;
            options.chunk_bytes = chunk_bytes;
            options.threads = threads;
            options.fault = fault;
            options.fault_at = fault_at;
            new (self) IoEngine(options);
          },
          "backend"_a, "queue_depth"_a, "chunk_bytes"_a, "threads"_a, "fault"_a, "fault_at"_a)
      .def(
          "submit",
          [](IoEngine& engine, const std::string& path, std::uintptr_t dst, std::size_t nbytes,
             std::uint64_t file_offset) {
            return engine.submit(path, reinterpret_cast<void*>(dst), nbytes, file_offset);
          },
          "path"_a, "dst"_a, "nbytes"_a, "file_offset"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("wait", &IoEngine::wait, "ticket"_a, "timeout_s"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("cancel", &IoEngine::cancel, "ticket"_a, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("backend", &IoEngine::backend_name)
      .def_prop_ro("queue_depth", [](const IoEngine& e) { return e.options().queue_depth; })
      .def_prop_ro("chunk_bytes", [](const IoEngine& e) { return e.options().chunk_bytes; });

  m.def("cpu_kernel_paths", &zerolite::supported_cpu_paths);
  m.def("cpu_kernel_path", [](const std::string& name) { return static_cast<int>(zerolite::cpu_path_named(name)); },
        "name"_a);
  m.def(
      "int4_matmul",
      [](std::uintptr_t x, std::int64_t rows, std::int64_t x_stride, std::uintptr_t y, std::int64_t y_stride,
         std::uintptr_t packed, std::int64_t out_features, std::int64_t in_features, std::int64_t stored_in,
         int group_size, int block_rows, bool halves, std::uintptr_t scale_zero, bool bf16_scales, int path,
         int threads, bool bf16_rows) {
        zerolite::Int4Weight weight{reinterpret_cast<const std::uint8_t*>(packed), out_features, in_features,
                                    stored_in, group_size, block_rows, halves,
                                    reinterpret_cast<const void*>(scale_zero), bf16_scales};
        zerolite::int4_matmul(weight, rows_of(x, rows, x_stride, y, y_stride, bf16_rows),
                              static_cast<zerolite::CpuPath>(path), threads);
      },
      "x"_a, "rows"_a, "x_stride"_a, "y"_a, "y_stride"_a, "packed"_a, "out_features"_a, "in_features"_a,
      "stored_in"_a, "group_size"_a, "block_rows"_a, "halves"_a, "scale_zero"_a, "bf16_scales"_a, "path"_a,
      "threads"_a, "bf16_rows"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "int4_dequantize_transposed",
      [](std::uintptr_t out, bool bf16, std::uintptr_t packed, std::int64_t out_features, std::int64_t in_features,
         std::int64_t stored_in, int group_size, int block_rows, bool halves, std::uintptr_t scale_zero,
         bool bf16_scales, int path, int threads) {
        zerolite::Int4Weight weight{reinterpret_cast<const std::uint8_t*>(packed), out_features, in_features,
                                    stored_in, group_size, block_rows, halves,
                                    reinterpret_cast<const void*>(scale_zero), bf16_scales};
        zerolite::int4_dequantize_transposed(weight, reinterpret_cast<void*>(out), bf16,
                                             static_cast<zerolite::CpuPath>(path), threads);
      },
      "out"_a, "bf16"_a, "packed"_a, "out_features"_a, "in_features"_a, "stored_in"_a, "group_size"_a,
      "block_rows"_a, "halves"_a, "scale_zero"_a, "bf16_scales"_a, "path"_a, "threads"_a,
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "int8_matmul",
      [](std::uintptr_t x, std::int64_t rows, std::int64_t x_stride, std::uintptr_t y, std::int64_t y_stride,
         std::uintptr_t q, std::int64_t out_features, std::int64_t in_features, std::uintptr_t scale, int path,
         int threads, bool bf16_rows) {
        zerolite::Int8Weight weight{reinterpret_cast<const std::int8_t*>(q), out_features, in_features,
                                    reinterpret_cast<const float*>(scale)};
        zerolite::int8_matmul(weight, rows_of(x, rows, x_stride, y, y_stride, bf16_rows),
                              static_cast<zerolite::CpuPath>(path), threads);
      },
      "x"_a, "rows"_a, "x_stride"_a, "y"_a, "y_stride"_a, "q"_a, "out_features"_a, "in_features"_a, "scale"_a,
      "path"_a, "threads"_a, "bf16_rows"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "bf16_matmul",
      [](std::uintptr_t x, std::int64_t rows, std::int64_t x_stride, std::uintptr_t y, std::int64_t y_stride,
         std::uintptr_t w, std::int64_t out_features, std::int64_t in_features, int path, int threads) {
        zerolite::Bf16Weight weight{reinterpret_cast<const std::uint16_t*>(w), out_features, in_features};
        zerolite::Bf16Rows r{reinterpret_cast<const std::uint16_t*>(x), rows, x_stride,
                             reinterpret_cast<std::uint16_t*>(y), y_stride};
        zerolite::bf16_matmul(weight, r, static_cast<zerolite::CpuPath>(path), threads);
      },
      "x"_a, "rows"_a, "x_stride"_a, "y"_a, "y_stride"_a, "w"_a, "out_features"_a, "in_features"_a, "path"_a,
      "threads"_a, nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "kv_decode",
      [](int codes, int dtype, std::int64_t width, std::int64_t group, std::int64_t tokens, std::int64_t share_bytes,
         std::uintptr_t packed, std::int64_t packed_outer_stride, std::int64_t packed_token_stride, std::uintptr_t out,
         std::int64_t out_outer_stride, std::int64_t out_token_stride, std::int64_t outer, std::int64_t rows, int path,
         int threads) {
        zerolite::KvFormat format{static_cast<zerolite::KvCodes>(codes), static_cast<zerolite::KvFloat>(dtype), width,
                                  group, tokens, share_bytes};
        zerolite::KvRows r{reinterpret_cast<const std::uint8_t*>(packed), packed_outer_stride, packed_token_stride,
                           reinterpret_cast<void*>(out), out_outer_stride, out_token_stride, outer, rows};
        zerolite::kv_decode(format, r, static_cast<zerolite::CpuPath>(path), threads);
      },
      "codes"_a, "dtype"_a, "width"_a, "group"_a, "tokens"_a, "share_bytes"_a, "packed"_a, "packed_outer_stride"_a,
      "packed_token_stride"_a, "out"_a, "out_outer_stride"_a, "out_token_stride"_a, "outer"_a, "rows"_a, "path"_a,
      "threads"_a, nb::call_guard<nb::gil_scoped_release>());
}
