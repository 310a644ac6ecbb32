// Build information, low-precision conversions, threshold tables and calibration.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "binding.hpp"
#include "sparse_attn/dtype.hpp"

namespace sparse_attn::python {

using namespace nb::literals;

namespace {

using FloatArray = nb::ndarray<const float, nb::device::cpu, nb::c_contig>;
using ByteArray = nb::ndarray<const std::uint8_t, nb::device::cpu, nb::c_contig>;

std::vector<std::size_t> shape_of(std::size_t ndim, const std::int64_t* shape) {
  std::vector<std::size_t> s(ndim);
  for (std::size_t i = 0; i < ndim; ++i) s[i] = static_cast<std::size_t>(shape[i]);
  return s;
}

template <class In, class Out, class F>
nb::ndarray<nb::numpy, Out> map_array(const nb::ndarray<const In, nb::device::cpu, nb::c_contig>& a, F f) {
  std::vector<Out> out(a.size());
  const In* src = a.data();
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = f(src[i]);
  return numpy_array(std::move(out), shape_of(a.ndim(), a.shape_ptr()));
}

nb::ndarray<nb::numpy, float> table_values(const ThresholdTable& t) {
  std::vector<float> v = t.values;
  return numpy_array(std::move(v), {t.budgets.size(), static_cast<std::size_t>(t.n_layers),
                                    static_cast<std::size_t>(t.n_heads), static_cast<std::size_t>(t.n_qtiles)});
}

void set_table_values(ThresholdTable& t, const FloatArray& a) {
  const std::size_t expect = ThresholdTable::value_count(t.budgets.size(), t.n_layers, t.n_heads, t.n_qtiles);
  if (a.size() != expect)
    throw Error("ThresholdTable", "values",
                "has " + std::to_string(a.size()) + " elements; [budgets, n_layers, n_heads, n_qtiles] needs " +
                    std::to_string(expect));
  t.values.assign(a.data(), a.data() + a.size());
}

}  // namespace

void bind_misc(nb::module_& m) {
  m.def("build_info", [] {
    const BuildInfo b = sparse_attn::build_info();
    nb::dict d;
    d["version"] = b.version;
    d["cuda"] = b.cuda;
    d["cuda_version"] = b.cuda_version;
    d["cuda_archs"] = b.cuda_archs;
    d["compiler"] = b.compiler;
    d["cpu_threads"] = b.cpu_threads;
    return d;
  });
  m.def("cuda_devices", [] {
    nb::list out;
    for (const DeviceInfo& i : sparse_attn::cuda_devices()) {
      nb::dict d;
      d["index"] = i.index;
      d["name"] = i.name;
      d["major"] = i.major;
      d["minor"] = i.minor;
      d["multiprocessors"] = i.multiprocessors;
      d["memory_bytes"] = i.memory_bytes;
      d["supported"] = i.supported;
      out.append(d);
    }
    return out;
  });
  m.def("cuda_available", &sparse_attn::cuda_available);
  m.def("check_device_faults", &sparse_attn::check_device_faults, "device"_a.none() = nb::none(),
        "Waits for CUDA device `device` (every device where a validated call ran, when None) and raises\n"
        "Error for the first fault that validated tile_sparse calls recorded there since the last report\n"
        "(their faulty tiles hold NaN). The same fault is also raised at the start of the next attention\n"
        "call on that device; each fault is raised once.");

  m.def("float_to_e4m3", [](const FloatArray& a) { return map_array<float, std::uint8_t>(a, float_to_e4m3); },
        "x"_a.noconvert(), "float32 -> e4m3 codes (uint8), saturating, round to nearest even.");
  m.def("e4m3_to_float", [](const ByteArray& a) { return map_array<std::uint8_t, float>(a, e4m3_to_float); },
        "codes"_a.noconvert());
  m.def("float_to_e2m1", [](const FloatArray& a) { return map_array<float, std::uint8_t>(a, float_to_e2m1); },
        "x"_a.noconvert(), "float32 -> e2m1 codes in the low nibble (uint8), saturating at 6.");
  m.def("e2m1_to_float", [](const ByteArray& a) { return map_array<std::uint8_t, float>(a, e2m1_to_float); },
        "codes"_a.noconvert());
  m.def(
      "quantize_dequantize",
      [](nb::ndarray<float, nb::device::cpu, nb::ndim<1>, nb::c_contig> row, const std::string& precision,
         float tensor_scale) {
        const IndexPrecision p = parse_precision("quantize_dequantize", precision);
        sparse_attn::quantize_dequantize(row.data(), static_cast<std::int64_t>(row.shape(0)), p, tensor_scale);
      },
      "row"_a.noconvert(), "precision"_a, "tensor_scale"_a,
      "Rounds a contiguous float32 row through an index precision, in place.");

  nb::class_<ThresholdTable>(m, "ThresholdTable",
                             "Calibrated block-max thresholds t[budget, layer, head, gate_tile] and their metadata.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ThresholdTable* t, std::vector<std::int64_t> budgets, std::int64_t n_layers, std::int64_t n_heads,
             std::int64_t n_qtiles, std::optional<FloatArray> values, std::int64_t tile_q, std::int64_t tile_k,
             std::string model, std::int64_t sink_blocks) {
            // Checked before construction: nanobind does not destroy an object whose __init__ throws.
            ThresholdTable table;
            table.budgets = std::move(budgets);
            table.n_layers = n_layers;
            table.n_heads = n_heads;
            table.n_qtiles = n_qtiles;
            table.tile_q = tile_q;
            table.tile_k = tile_k;
            table.model = std::move(model);
            table.sink_blocks = sink_blocks;
            if (values) set_table_values(table, *values);
            else table.values.assign(ThresholdTable::value_count(table.budgets.size(), n_layers, n_heads, n_qtiles), 0.0f);
            table.validate();
            new (t) ThresholdTable(std::move(table));
          },
          "budgets"_a, "n_layers"_a, "n_heads"_a, "n_qtiles"_a, "values"_a.none() = nb::none(), "tile_q"_a = kGateRows,
          "tile_k"_a = kBlockK, "model"_a = "", "sink_blocks"_a = 1)
      .def("__init__", constructor_type_error<ThresholdTable>("ThresholdTable"))
      // The extents describe `values`: read-only, so that they cannot disagree with it.
      .def_ro("budgets", &ThresholdTable::budgets)
      .def_ro("n_layers", &ThresholdTable::n_layers)
      .def_ro("n_heads", &ThresholdTable::n_heads)
      .def_ro("n_qtiles", &ThresholdTable::n_qtiles)
      .def_rw("tile_q", &ThresholdTable::tile_q)
      .def_rw("tile_k", &ThresholdTable::tile_k)
      .def_rw("model", &ThresholdTable::model)
      .def_rw("sink_blocks", &ThresholdTable::sink_blocks)
      .def_prop_rw(
          "values",
          // A fresh array that owns its copy: the default property policy (reference_internal)
          // does not apply to an array with its own owner.
          [](const ThresholdTable& t) { return nb::cast(table_values(t), nb::rv_policy::move); },
          &set_table_values,
                   "float32 [n_budgets, n_layers, n_heads, n_qtiles] (a copy; assign to replace)")
      .def("at", &ThresholdTable::at, "budget"_a, "layer"_a, "head"_a, "qtile"_a)
      .def(
          "slice",
          [](const ThresholdTable& t, std::int64_t budget, std::int64_t layer) {
            const TensorView v = t.slice(budget, layer);
            std::vector<float> copy(static_cast<std::size_t>(v.numel()));
            if (!copy.empty()) std::memcpy(copy.data(), v.data, copy.size() * sizeof(float));
            return numpy_array(std::move(copy), {static_cast<std::size_t>(v.shape[0]), static_cast<std::size_t>(v.shape[1])});
          },
          "budget"_a, "layer"_a, "float32 [n_heads, n_qtiles] copy of one budget slice and layer, as gated() takes it.")
      .def("budget_index", &ThresholdTable::budget_index, "k"_a)
      .def(
          "save",
          [](const ThresholdTable& t, const std::string& path) {
            nb::gil_scoped_release release;
            t.save(path);
          },
          "path"_a)
      .def_static(
          "load",
          [](const std::string& path) {
            nb::gil_scoped_release release;
            return ThresholdTable::load(path);
          },
          "path"_a)
      .def("__repr__", [](const ThresholdTable& t) {
        std::string b;
        for (std::size_t i = 0; i < t.budgets.size(); ++i) b += (i ? ", " : "") + std::to_string(t.budgets[i]);
        return "ThresholdTable(budgets=[" + b + "], n_layers=" + std::to_string(t.n_layers) +
               ", n_heads=" + std::to_string(t.n_heads) + ", n_qtiles=" + std::to_string(t.n_qtiles) +
               ", tile=" + std::to_string(t.tile_q) + "x" + std::to_string(t.tile_k) +
               ", sink_blocks=" + std::to_string(t.sink_blocks) + ", model='" + t.model + "')";
      });

  nb::class_<Calibrator>(m, "Calibrator", "Accumulates per-sample gate thresholds and averages them.")
      .def(nb::init<std::vector<std::int64_t>, std::int64_t, std::string, std::int64_t>(), "budgets"_a, "n_layers"_a,
           "model"_a = "", "sink_blocks"_a = 1)
      .def("__init__", constructor_type_error<Calibrator>("Calibrator"))
      .def(
          "add",
          [](Calibrator& c, std::int64_t layer, nb::handle q, nb::handle k, std::optional<float> scale) {
            Imports im("Calibrator.add");
            const TensorView qv = im.in(q, "q"), kv = im.in(k, "k");
            nb::gil_scoped_release release;
            c.add(layer, qv, kv, scale);
          },
          "layer"_a, "q"_a, "k"_a, "softmax_scale"_a.none() = nb::none(),
          "Adds one sample's layer: q [1, L, Hq, D], k [1, L, Hkv, D] on the CPU or a CUDA device (there "
          "the block maxima are computed by the GPU, bf16 or f16, D <= 128).")
      .def("finish", &Calibrator::finish);
}

}  // namespace sparse_attn::python
