// safetensors reader and writer.
//
// Reading trusts nothing in the file: the path must name a regular file within the size limits, the
// header length is checked against the file size, the header bytes are checked in one linear pass
// (UTF-8, no control bytes, bounded nesting) before the JSON parser sees them, and every dtype, shape
// and offset pair is checked against the others and the file size before any tensor byte is copied.
// As in the reference implementation, the tensors must cover the data section exactly (no
// overlaps, no holes), which rules out files that smuggle other content past the header.
#include "core/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <set>

#include <nlohmann/json.hpp>

#include "sparse_attn/error.hpp"

namespace sparse_attn::detail {

namespace {

using ojson = nlohmann::ordered_json;

constexpr const char* kOp = "safetensors";

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

/// "0x7f"
std::string hex_byte(unsigned c) {
  constexpr char kDigits[] = "0123456789abcdef";
  return {'0', 'x', kDigits[(c >> 4) & 15], kDigits[c & 15]};
}

/// Length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlong forms, no surrogates,
/// nothing past U+10FFFF), 0 when there is none.
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto at = [&](std::size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0u; };
  const auto cont = [&](std::size_t k, unsigned lo = 0x80, unsigned hi = 0xBF) { return at(k) >= lo && at(k) <= hi; };
  const unsigned c = at(0);
  if (i >= s.size()) return 0;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    const bool second = c == 0xE0 ? cont(1, 0xA0) : c == 0xED ? cont(1, 0x80, 0x9F) : cont(1);
    return second && cont(2) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    const bool second = c == 0xF0 ? cont(1, 0x90) : c == 0xF4 ? cont(1, 0x80, 0x8F) : cont(1);
    return second && cont(2) && cont(3) ? 4 : 0;
  }
  return 0;
}

bool is_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

struct JsonScan {
  std::string fault;                                  // empty: the text may be parsed
  std::size_t value_end = std::string_view::npos;    // just past the bracket closing the first value
};

JsonScan scan_json(std::string_view text, std::size_t max_depth) {
  JsonScan r;
  std::size_t depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {
      const std::size_t n = utf8_length(text, i);
      if (n == 0) {
        r.fault = "byte " + hex_byte(c) + " at offset " + std::to_string(i) + " is not UTF-8";
        return r;
      }
      escaped = false;
      i += n;
      continue;
    }
    if (c < 0x20 && (in_string || (c != '\t' && c != '\n' && c != '\r'))) {
      r.fault = "control byte " + hex_byte(c) + " at offset " + std::to_string(i);
      return r;
    }
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        r.fault = "nests deeper than " + std::to_string(max_depth) + " levels (at offset " + std::to_string(i) + ")";
        return r;
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      if (--depth == 0 && r.value_end == std::string_view::npos) r.value_end = i + 1;
    }
    ++i;
  }
  return r;
}

/// A JSON value as an error message shows it: numbers in full, strings shortened, containers by type.
std::string brief(const ojson& v) {
  if (v.is_number() || v.is_boolean() || v.is_null()) return v.dump();
  if (v.is_string()) return "'" + printable(v.get_ref<const std::string&>(), 40) + "'";
  return std::string("of type ") + v.type_name();
}

}  // namespace

std::string untrusted_json_fault(std::string_view text, std::size_t max_depth) {
  return scan_json(text, max_depth).fault;
}

std::string printable(std::string_view s, std::size_t max_bytes) {
  std::string out;
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t n = utf8_length(s, i);
    const bool plain = n > 1 || (n == 1 && c >= 0x20 && c != 0x7f);
    const std::size_t width = plain ? n : 4;
    if (out.size() + width > max_bytes) return out + "...";
    if (plain) out.append(s.substr(i, n));
    else out += "\\x" + hex_byte(c).substr(2);
    i += plain ? n : 1;
  }
  return out;
}

std::size_t safetensors_dtype_size(const std::string& dtype) {
  static const std::pair<const char*, std::size_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8},
  };
  for (const auto& [name, size] : kSizes)
    if (dtype == name) return size;
  throw Error(kOp, "dtype", "unknown safetensors dtype '" + printable(dtype) + "'");
}

const SafetensorsEntry& SafetensorsFile::get(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return t;
  throw Error(kOp, name, "the file has no tensor called '" + printable(name) + "'");
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(), [&](const SafetensorsEntry& t) { return t.name == name; });
}

void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  const auto fail = [&](const std::string& message) { throw Error(kOp, path, message); };
  ojson header = ojson::object();
  if (!file.metadata.empty()) {
    ojson meta = ojson::object();
    for (const auto& [k, v] : file.metadata) {
      if (!is_utf8(k) || !is_utf8(v)) fail("__metadata__ entry '" + printable(k) + "' is not UTF-8 text");
      meta[k] = v;
    }
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const auto& t : file.tensors) {
    const std::string what = "tensor '" + printable(t.name) + "'";
    if (t.name.empty() || t.name == "__metadata__" || !is_utf8(t.name)) fail("invalid tensor name '" + printable(t.name) + "'");
    if (!names.insert(t.name).second) fail("duplicate " + what);
    std::size_t elem = 0;
    try {
      elem = safetensors_dtype_size(t.dtype);
    } catch (const Error&) {
      fail(what + " has unknown dtype '" + printable(t.dtype) + "'");
    }
    const std::int64_t bytes = byte_size(t.shape, elem);
    if (bytes < 0) fail(what + " has an invalid shape " + shape_text(t.shape));
    if (static_cast<std::uint64_t>(bytes) != t.data.size())
      fail(what + " of shape " + shape_text(t.shape) + " and dtype " + t.dtype + " needs " + std::to_string(bytes) +
           " bytes but holds " + std::to_string(t.data.size()));
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  // Padding the header keeps the data section 8-byte aligned (the 8-byte length precedes it).
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > SafetensorsLimits{}.max_header_bytes)
    fail("the header would take " + std::to_string(text.size()) + " bytes, more than the " +
         std::to_string(SafetensorsLimits{}.max_header_bytes) + " a reader accepts");

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail("cannot open the file for writing");
  unsigned char len[8];
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : file.tensors)
    out.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size()));
  out.close();
  if (!out) fail("write failed");
}

SafetensorsFile read_safetensors(const std::string& path, const std::string& op, const SafetensorsLimits& limits) {
  const auto fail = [&](const std::string& message) { throw Error(op, path, message); };
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) fail("cannot open the file for reading: no such file");
  if (fs::is_directory(status)) fail("cannot read the file: it is a directory");
  if (!fs::is_regular_file(status)) fail("cannot read the file: it is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open the file for reading: permission denied or I/O error");
  const std::uint64_t size = fs::file_size(path, ec);
  if (ec) fail("cannot determine the file size: " + ec.message());
  if (size > limits.max_file_bytes)
    fail("file of " + std::to_string(size) + " bytes is larger than the limit of " +
         std::to_string(limits.max_file_bytes));
  if (size < 8) fail("file is too short (" + std::to_string(size) + " bytes) to hold the 8-byte header length");

  unsigned char len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  if (in.gcount() != 8) fail("read of the header length failed");
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= std::uint64_t(len[i]) << (8 * i);
  if (header_len > limits.max_header_bytes)
    fail("header length " + std::to_string(header_len) + " is over the limit of " +
         std::to_string(limits.max_header_bytes) + " bytes");
  if (header_len > size - 8)
    fail("header length " + std::to_string(header_len) + " runs past the end of the file (" + std::to_string(size) +
         " bytes)");
  std::string text(static_cast<std::size_t>(header_len), '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  if (static_cast<std::uint64_t>(in.gcount()) != header_len) fail("read of the header failed");

  // The parser sees only text that passed the linear scan: nlohmann's values are recursive to copy,
  // compare and print, and its lexer takes a NUL for the end of the input.
  const JsonScan scan = scan_json(text, limits.max_depth);
  if (!scan.fault.empty()) fail("header " + scan.fault);
  if (text.empty() || text.front() != '{') fail("header does not start with '{'");
  if (scan.value_end != std::string::npos) {
    const std::size_t pad = text.find_first_not_of(' ', scan.value_end);
    if (pad != std::string::npos)
      fail("header holds bytes other than space padding after its JSON object (offset " + std::to_string(pad) + ")");
  }
  ojson header;
  try {
    header = ojson::parse(text);
  } catch (const std::exception& e) {
    fail("header is not valid JSON: " + printable(e.what(), 200));
  }

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
      if (!v.is_object()) fail("__metadata__ is not a JSON object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail("__metadata__ entry '" + printable(m.key()) + "' is not a string");
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + printable(name) + "'";
    if (name.empty()) fail("a tensor has an empty name");
    if (!v.is_object()) fail(what + " is not a JSON object");
    const auto dtype = v.find("dtype"), shape = v.find("shape"), offsets = v.find("data_offsets");
    if (dtype == v.end() || !dtype->is_string()) fail(what + " has no string 'dtype'");
    if (shape == v.end() || !shape->is_array()) fail(what + " has no array 'shape'");
    if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2) fail(what + " has no 'data_offsets' pair");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dtype->get<std::string>();
    std::size_t elem = 0;
    try {
      elem = safetensors_dtype_size(e.dtype);
    } catch (const Error&) {
      fail(what + " has unknown dtype '" + printable(e.dtype) + "'");
    }
    for (const ojson& s : *shape) {
      if (!s.is_number_unsigned() || s.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
        fail(what + " has an invalid shape entry " + brief(s));
      e.shape.push_back(s.get<std::int64_t>());
    }
    for (const ojson& o : *offsets)
      if (!o.is_number_unsigned()) fail(what + " has an invalid data offset " + brief(o));
    const auto begin = (*offsets)[0].get<std::uint64_t>();
    const auto stop = (*offsets)[1].get<std::uint64_t>();
    if (begin > stop || stop > data_size)
      fail(what + " has data offsets [" + std::to_string(begin) + ", " + std::to_string(stop) +
           ") outside the data section of " + std::to_string(data_size) + " bytes");
    const std::int64_t bytes = byte_size(e.shape, elem);
    if (bytes < 0 || static_cast<std::uint64_t>(bytes) != stop - begin)
      fail(what + " of shape " + shape_text(e.shape) + " and dtype " + e.dtype + " needs " +
           (bytes < 0 ? std::string("an overflowing number of") : std::to_string(bytes)) + " bytes but its offsets span " +
           std::to_string(stop - begin));
    spans.push_back({begin, stop, file.tensors.size()});
    file.tensors.push_back(std::move(e));
  }

  // Stable: empty tensors sharing an offset keep their header order, so a file written back from
  // what was read reads back the same.
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  for (const Span& s : spans) {
    const std::string name = printable(file.tensors[s.tensor].name);
    if (s.begin < covered)
      fail("tensor '" + name + "' at offsets [" + std::to_string(s.begin) + ", " + std::to_string(s.end) +
           ") overlaps the previous tensor, which ends at " + std::to_string(covered));
    if (s.begin > covered)
      fail("data bytes [" + std::to_string(covered) + ", " + std::to_string(s.begin) + ") belong to no tensor (before tensor '" +
           name + "')");
    covered = s.end;
  }
  if (covered != data_size)
    fail("data bytes [" + std::to_string(covered) + ", " + std::to_string(data_size) + ") belong to no tensor");

  // Return the tensors in file order, which is the order they were written in.
  std::vector<SafetensorsEntry> ordered;
  ordered.reserve(spans.size());
  const std::uint64_t data_start = 8 + header_len;
  for (const Span& s : spans) {
    SafetensorsEntry& e = file.tensors[s.tensor];
    try {
      e.data.resize(static_cast<std::size_t>(s.end - s.begin));
    } catch (const std::bad_alloc&) {
      fail("cannot allocate " + std::to_string(s.end - s.begin) + " bytes for tensor '" + printable(e.name) + "'");
    }
    in.seekg(static_cast<std::streamoff>(data_start + s.begin), std::ios::beg);
    in.read(reinterpret_cast<char*>(e.data.data()), static_cast<std::streamsize>(e.data.size()));
    if (static_cast<std::uint64_t>(in.gcount()) != e.data.size() || !in)
      fail("read of tensor '" + printable(e.name) + "' failed");
    ordered.push_back(std::move(e));
  }
  file.tensors = std::move(ordered);
  return file;
}

}  // namespace sparse_attn::detail
