// Minimal safetensors reader and writer (https://huggingface.co/docs/safetensors format: an 8-byte
// little-endian header length, a JSON header, then the raw little-endian tensor bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace sparse_attn::detail {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;               // "F32", "F16", "BF16", "F64", "I32", "I64", "U8", "U32"
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;     // raw bytes, size = prod(shape) * element size
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;  // the "__metadata__" string map
  std::vector<SafetensorsEntry> tensors;

  /// The tensor called `name`; throws Error(op "safetensors", argument name) when absent.
  const SafetensorsEntry& get(const std::string& name) const;
  bool contains(const std::string& name) const;
};

/// What a reader accepts from an untrusted file; the defaults hold any file this library writes.
struct SafetensorsLimits {
  std::uint64_t max_header_bytes = 100'000'000;  // the reference implementation's limit
  std::uint64_t max_file_bytes = std::uint64_t{1} << 40;
  // A header nests three deep ({"name": {"shape": [...]}}); deeper JSON is refused before parsing.
  std::size_t max_depth = 8;
};

/// Element size of a safetensors dtype string; throws on an unknown one.
std::size_t safetensors_dtype_size(const std::string& dtype);
/// Writes the file (tensors in the order given). Throws Error on I/O failure, inconsistent sizes, an
/// empty or repeated tensor name, a name or metadata string that is not UTF-8, or a header longer
/// than the default SafetensorsLimits allow (the reader would refuse the file).
void write_safetensors(const std::string& path, const SafetensorsFile& file);
/// Reads and validates the whole file: a regular file within `limits`, the header length against
/// the file size, the header as UTF-8 JSON (one object starting at its first byte, padded with
/// spaces only, nested at most limits.max_depth deep), every dtype x shape against its data offsets
/// (overflow-checked) and the offsets covering the data section exactly. Throws Error(op, path, what).
SafetensorsFile read_safetensors(const std::string& path, const std::string& op = "safetensors",
                                 const SafetensorsLimits& limits = {});

/// The first reason `text` is not safe to hand to nlohmann::json, empty when there is none: bytes
/// that are not UTF-8, control bytes other than JSON whitespace (a NUL would end nlohmann's input
/// early), or [ and { nested deeper than `max_depth`. One linear pass outside and inside strings,
/// no recursion, so any input is checked in bounded stack.
std::string untrusted_json_fault(std::string_view text, std::size_t max_depth);
/// `s` fit for an error message: its first `max_bytes` bytes (then "..."), control bytes and bytes that are not
/// UTF-8 written as \xNN (callers such as Python decode messages as UTF-8).
std::string printable(std::string_view s, std::size_t max_bytes = 80);

}  // namespace sparse_attn::detail
