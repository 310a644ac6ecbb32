// sparse_attn._ext: the one binding of the C++ API. The Python-facing conventions (allocation of
// outputs, flash-attn argument names, torch streams) live in the pure-Python package around it;
// this module takes every array, output included, explicitly.
#include "binding.hpp"

namespace nb = nanobind;

NB_MODULE(_ext, m) {
  m.doc() = "Bindings of the sparse_attn C++ library (arrays through DLPack).";
  // A subclass of ValueError, so callers that catch ValueError for bad input keep working; the
  // message is the C++ one: "<op>: argument '<name>': <what is wrong>".
  nb::exception<sparse_attn::Error>(m, "Error", PyExc_ValueError);
  sparse_attn::python::bind_ops(m);
  sparse_attn::python::bind_selectors(m);
  sparse_attn::python::bind_formats(m);
  sparse_attn::python::bind_misc(m);
  sparse_attn::python::bind_plan(m);
}
