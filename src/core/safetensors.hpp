// Minimal safetensors reader and writer (https://huggingface.co/docs/safetensors format: an 8-byte
// little-endian header length, a JSON header, then the raw little-endian tensor bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
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

/// Element size of a safetensors dtype string; throws on an unknown one.
std::size_t safetensors_dtype_size(const std::string& dtype);
/// Writes the file (tensors in the order given). Throws Error on I/O failure or inconsistent sizes.
void write_safetensors(const std::string& path, const SafetensorsFile& file);
/// Reads and validates the whole file (header bounds, offsets, sizes). Throws Error naming the path.
SafetensorsFile read_safetensors(const std::string& path);

}  // namespace sparse_attn::detail
