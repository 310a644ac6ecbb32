// safetensors reader and writer.
//
// Reading trusts nothing in the file: the header length, the JSON, every dtype, shape and offset
// pair are checked against each other and against the file size before any tensor byte is copied.
// As in the reference implementation, the tensors must cover the data section exactly (no
// overlaps, no holes), which rules out files that smuggle other content past the header.
#include "core/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "sparse_attn/error.hpp"

namespace sparse_attn::detail {

namespace {

using ojson = nlohmann::ordered_json;

constexpr const char* kOp = "safetensors";

[[noreturn]] void fail(const std::string& path, const std::string& message) { throw Error(kOp, path, message); }

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// prod(shape) * element size, or -1 when an extent is negative or the count overflows int64.
std::int64_t byte_size(const std::vector<std::int64_t>& shape, std::size_t elem) {
  std::int64_t n = static_cast<std::int64_t>(elem);
  for (std::int64_t s : shape) {
    if (s < 0) return -1;
    if (s != 0 && n > std::numeric_limits<std::int64_t>::max() / s) return -1;
    n *= s;
  }
  return n;
}

}  // namespace

std::size_t safetensors_dtype_size(const std::string& dtype) {
  static const std::pair<const char*, std::size_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8},
  };
  for (const auto& [name, size] : kSizes)
    if (dtype == name) return size;
  throw Error(kOp, "dtype", "unknown safetensors dtype '" + dtype + "'");
}

const SafetensorsEntry& SafetensorsFile::get(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  throw Error(kOp, name, "the file has no tensor called '" + name + "'");
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(), [&](const SafetensorsEntry& t) { return t.name == name; });
}

void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  ojson header = ojson::object();
  if (!file.metadata.empty()) {
    ojson meta = ojson::object();
    for (const auto& [k, v] : file.metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const auto& t : file.tensors) {
    const std::string what = "tensor '" + t.name + "'";
    if (t.name.empty() || t.name == "__metadata__") fail(path, "invalid tensor name '" + t.name + "'");
    if (!names.insert(t.name).second) fail(path, "duplicate " + what);
    std::size_t elem = 0;
    try {
      elem = safetensors_dtype_size(t.dtype);
    } catch (const Error&) {
      fail(path, what + " has unknown dtype '" + t.dtype + "'");
    }
    const std::int64_t bytes = byte_size(t.shape, elem);
    if (bytes < 0) fail(path, what + " has an invalid shape " + shape_text(t.shape));
    if (static_cast<std::uint64_t>(bytes) != t.data.size())
      fail(path, what + " of shape " + shape_text(t.shape) + " and dtype " + t.dtype + " needs " +
                     std::to_string(bytes) + " bytes but holds " + std::to_string(t.data.size()));
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  // Padding the header keeps the data section 8-byte aligned (the 8-byte length precedes it).
  text.append((8 - text.size() % 8) % 8, ' ');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, "cannot open the file for writing");
  unsigned char len[8];
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : file.tensors)
    out.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size()));
  out.close();
  if (!out) fail(path, "write failed");
}

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open the file for reading");
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  if (end < 0) fail(path, "cannot determine the file size");
  const auto size = static_cast<std::uint64_t>(end);
  in.seekg(0, std::ios::beg);
  if (size < 8) fail(path, "file is too short (" + std::to_string(size) + " bytes) to hold the 8-byte header length");

  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= std::uint64_t(len[i]) << (8 * i);
  if (header_len > size - 8)
    fail(path, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes)");
  std::string text(static_cast<std::size_t>(header_len), '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  if (!in) fail(path, "read of the header failed");

  ojson header;
  try {
    header = ojson::parse(text);
  } catch (const std::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");

  const std::uint64_t data_size = size - 8 - header_len;
  SafetensorsFile file;
  struct Span {
    std::uint64_t begin, end;
    std::size_t tensor;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const ojson& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, "__metadata__ is not a JSON object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail(path, "__metadata__ entry '" + m.key() + "' is not a string");
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (!v.is_object()) fail(path, what + " is not a JSON object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail(path, what + " has no string 'dtype'");
    if (!v.contains("shape") || !v["shape"].is_array()) fail(path, what + " has no array 'shape'");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      fail(path, what + " has no 'data_offsets' pair");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = v["dtype"].get<std::string>();
    std::size_t elem = 0;
    try {
      elem = safetensors_dtype_size(e.dtype);
    } catch (const Error&) {
      fail(path, what + " has unknown dtype '" + e.dtype + "'");
    }
    for (const ojson& s : v["shape"]) {
      if (!s.is_number_unsigned() || s.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
        fail(path, what + " has an invalid shape entry " + s.dump());
      e.shape.push_back(s.get<std::int64_t>());
    }
    for (const ojson& o : v["data_offsets"])
      if (!o.is_number_unsigned()) fail(path, what + " has an invalid data offset " + o.dump());
    const auto begin = v["data_offsets"][0].get<std::uint64_t>();
    const auto stop = v["data_offsets"][1].get<std::uint64_t>();
    if (begin > stop || stop > data_size)
      fail(path, what + " has data offsets [" + std::to_string(begin) + ", " + std::to_string(stop) +
                     ") outside the data section of " + std::to_string(data_size) + " bytes");
    const std::int64_t bytes = byte_size(e.shape, elem);
    if (bytes < 0 || static_cast<std::uint64_t>(bytes) != stop - begin)
      fail(path, what + " of shape " + shape_text(e.shape) + " and dtype " + e.dtype + " needs " +
                     (bytes < 0 ? std::string("an overflowing number of") : std::to_string(bytes)) +
                     " bytes but its offsets span " + std::to_string(stop - begin));
    spans.push_back({begin, stop, file.tensors.size()});
    file.tensors.push_back(std::move(e));
  }

  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  for (const Span& s : spans) {
    const std::string& name = file.tensors[s.tensor].name;
    if (s.begin < covered)
      fail(path, "tensor '" + name + "' at offsets [" + std::to_string(s.begin) + ", " + std::to_string(s.end) +
                     ") overlaps the previous tensor, which ends at " + std::to_string(covered));
    if (s.begin > covered)
      fail(path, "data bytes [" + std::to_string(covered) + ", " + std::to_string(s.begin) +
                     ") belong to no tensor (before tensor '" + name + "')");
    covered = s.end;
  }
  if (covered != data_size)
    fail(path, "data bytes [" + std::to_string(covered) + ", " + std::to_string(data_size) + ") belong to no tensor");

  // Return the tensors in file order, which is the order they were written in.
  std::vector<SafetensorsEntry> ordered;
  ordered.reserve(spans.size());
  const std::uint64_t data_start = 8 + header_len;
  for (const Span& s : spans) {
    SafetensorsEntry& e = file.tensors[s.tensor];
    e.data.resize(static_cast<std::size_t>(s.end - s.begin));
    in.seekg(static_cast<std::streamoff>(data_start + s.begin), std::ios::beg);
    in.read(reinterpret_cast<char*>(e.data.data()), static_cast<std::streamsize>(e.data.size()));
    if (!in) fail(path, "read of tensor '" + e.name + "' failed");
    ordered.push_back(std::move(e));
  }
  file.tensors = std::move(ordered);
  return file;
}

}  // namespace sparse_attn::detail
