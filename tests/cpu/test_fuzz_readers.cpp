// Seeded mutation fuzzing of the file readers: safetensors (any file), threshold tables, and the JSON
// pre-scan that guards every JSON text read from a file. Each case mutates a valid seed file (bit
// flips, interesting bytes and numbers, insertions of nesting and escapes, deletions, truncation,
// length prefixes that agree or disagree with the header) and requires that the reader either
// loads it or throws sparse_attn::Error: no crash, no hang, no other exception. A file that loads
// must round-trip: written back and read again, it gives the same content.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/safetensors.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("sparse_attn_fuzz_" + std::to_string(::getpid()) + "_" + name + ".safetensors"))
      .string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& b) {
  // A new file rather than a truncated one: some file systems flush a truncated file on close.
  std::filesystem::remove(path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

std::uint64_t length_prefix(const std::string& b) {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < 8 && i < b.size(); ++i) n |= std::uint64_t(static_cast<unsigned char>(b[i])) << (8 * i);
  return n;
}

void set_length_prefix(std::string& b, std::uint64_t n) {
  for (std::size_t i = 0; i < 8 && i < b.size(); ++i) b[i] = static_cast<char>(n >> (8 * i));
}

detail::SafetensorsEntry entry(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape,
                               std::mt19937_64& rng) {
  detail::SafetensorsEntry e{name, dtype, std::move(shape), {}};
  std::size_t n = detail::safetensors_dtype_size(dtype);
  for (std::int64_t s : e.shape) n *= static_cast<std::size_t>(s);
  e.data.resize(n);
  for (auto& b : e.data) b = static_cast<std::byte>(rng());
  return e;
}

/// A file with every kind of entry: several dtypes, an empty tensor, a scalar, metadata with JSON
/// inside a string (as the eval input's needles are stored).
std::string generic_seed(const std::string& path) {
  std::mt19937_64 rng(1);
  detail::SafetensorsFile f;
  f.metadata = {{"format", "fuzz"}, {"sparse_attn.needles", R"([{"b":0,"group":1,"keys":[16,32]}])"}};
  f.tensors.push_back(entry("q", "BF16", {1, 3, 2, 4}, rng));
  f.tensors.push_back(entry("w", "F32", {1, 3, 2}, rng));
  f.tensors.push_back(entry("empty", "I32", {0, 4}, rng));
  f.tensors.push_back(entry("scalar", "F64", {}, rng));
  f.tensors.push_back(entry("ids", "I64", {3}, rng));
  detail::write_safetensors(path, f);
  return read_bytes(path);
}

std::string thresholds_seed(const std::string& path) {
  ThresholdTable t;
  t.budgets = {2, 8};
  t.n_layers = 2;
  t.n_heads = 3;
  t.n_qtiles = 2;
  t.model = "fuzz/model";
  for (std::size_t i = 0; i < 24; ++i) t.values.push_back(i % 5 == 0 ? -INFINITY : 0.25f * float(i));
  t.save(path);
  return read_bytes(path);
}

class Mutator {
 public:
  explicit Mutator(std::uint64_t seed) : rng_(seed) {}

  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng_() % n); }

  /// 1 to 4 mutations of `b`; a file keeps its length prefix consistent with its header half the time,
  /// so that mutations inside the header reach the JSON checks rather than stopping at the length.
  std::string mutate(std::string b, bool file) {
    const std::uint64_t header = file ? length_prefix(b) : 0;
    const std::size_t before = b.size();
    const std::size_t rounds = 1 + below(4);
    for (std::size_t r = 0; r < rounds; ++r) mutate_once(b, file ? 8 : 0, file ? 8 + header : b.size());
    if (file && b.size() >= 8 && below(2) == 0) {
      const auto delta = static_cast<std::int64_t>(b.size()) - static_cast<std::int64_t>(before);
      set_length_prefix(b, static_cast<std::uint64_t>(static_cast<std::int64_t>(header) + delta));
    }
    return b;
  }

 private:
  // Bytes and tokens that stress a JSON reader: brackets, quotes, escapes, NUL, bytes that are not
  // UTF-8, and numbers at the edges of int64, uint64 and double.
  static const std::vector<std::string>& tokens() {
    static const std::vector<std::string> t = {
        "[", "]", "{", "}", "\"", "\\", ",", ":", " ", std::string(1, '\0'), "\xff", "\xc0\x80", "\xed\xa0\x80",
        "\xf4\x90\x80\x80", "\\u0000", "\\ud800", "\\u00e9", "-1", "0", "-0", "1e999", "1.5", "null", "true",
        "9223372036854775807", "9223372036854775808", "18446744073709551615", "18446744073709551616",
        "4294967296", "\"__metadata__\"", "\"\"", std::string(64, '['), std::string(4096, '['), "{\"a\":",
    };
    return t;
  }

  /// One mutation, mostly inside [lo, hi) (the header of a file, all of a JSON text).
  void mutate_once(std::string& b, std::size_t lo, std::size_t hi) {
    hi = std::min(hi, b.size());
    const auto pos = [&] { return hi > lo && below(8) != 0 ? lo + below(hi - lo) : below(b.size() + 1); };
    switch (below(9)) {
      case 0:  // bit flip
        if (!b.empty()) {
          const std::size_t i = std::min(pos(), b.size() - 1);
          b[i] = static_cast<char>(b[i] ^ (1 << below(8)));
        }
        break;
      case 1:  // random byte
        if (!b.empty()) b[std::min(pos(), b.size() - 1)] = static_cast<char>(rng_());
        break;
      case 2:  // insert a token
      case 3:
        b.insert(pos(), tokens()[below(tokens().size())]);
        break;
      case 4: {  // replace the digits of a number in the header by a token
        std::size_t i = pos();
        while (i < b.size() && i < hi && !std::isdigit(static_cast<unsigned char>(b[i]))) ++i;
        std::size_t j = i;
        while (j < b.size() && std::isdigit(static_cast<unsigned char>(b[j]))) ++j;
        if (j > i) b.replace(i, j - i, tokens()[17 + below(tokens().size() - 17)]);
        break;
      }
      case 5: {  // delete a range
        const std::size_t i = pos();
        if (i < b.size()) b.erase(i, 1 + below(std::min<std::size_t>(32, b.size() - i)));
        break;
      }
      case 6:  // truncate
        b.resize(below(b.size() + 1));
        break;
      case 7: {  // duplicate a range
        const std::size_t i = pos();
        if (i < b.size()) b.insert(pos(), b.substr(i, 1 + below(64)));
        break;
      }
      case 8:  // a length prefix of any size
        if (lo == 8 && b.size() >= 8) {
          const std::uint64_t n = length_prefix(b);
          const std::uint64_t choices[] = {0, n - 1, n + 1, n + 8, rng_(), std::uint64_t(1) << 63, ~std::uint64_t(0),
                                           static_cast<std::uint64_t>(b.size())};
          set_length_prefix(b, choices[below(std::size(choices))]);
        }
        break;
    }
  }

  std::mt19937_64 rng_;
};

/// Runs `cases` mutations of `seed` through `check`, which returns normally or throws Error. Any
/// other exception fails the test with the case number; a crash or hang fails the whole binary.
template <class Check>
void fuzz(const std::string& name, const std::string& seed, int cases, bool file, std::uint64_t rng_seed,
          Check&& check) {
  Mutator m(rng_seed);
  int loaded = 0, rejected = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int c = 0; c < cases; ++c) {
    const std::string input = m.mutate(seed, file);
    try {
      check(input);
      ++loaded;
    } catch (const Error& e) {
      ++rejected;
      // Python decodes messages as UTF-8: a file's bytes must not reach them raw.
      ASSERT_EQ(detail::untrusted_json_fault(e.what(), SIZE_MAX), "") << name << " case " << c << ": " << e.what();
    } catch (const std::exception& e) {
      FAIL() << name << " case " << c << ": " << typeid(e).name() << ": " << e.what();
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s: %d cases (%d loaded, %d rejected) in %.2f s\n", name.c_str(), cases, loaded, rejected, s);
  EXPECT_GT(rejected, cases / 10) << "the mutations hardly reach the checks";
}

void expect_same(const detail::SafetensorsFile& a, const detail::SafetensorsFile& b, const std::string& what) {
  EXPECT_EQ(a.metadata, b.metadata) << what;
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << what;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name) << what;
    EXPECT_EQ(a.tensors[i].dtype, b.tensors[i].dtype) << what;
    EXPECT_EQ(a.tensors[i].shape, b.tensors[i].shape) << what;
    EXPECT_EQ(a.tensors[i].data, b.tensors[i].data) << what;
  }
}

TEST(FuzzReaders, Safetensors) {
  const std::string path = temp_path("st"), back = temp_path("st_back");
  const std::string seed = generic_seed(path);
  fuzz("safetensors", seed, 10000, true, 1, [&](const std::string& input) {
    write_bytes(path, input);
    const detail::SafetensorsFile f = detail::read_safetensors(path);
    std::filesystem::remove(back);
    detail::write_safetensors(back, f);
    expect_same(f, detail::read_safetensors(back), "round trip");
  });
  std::filesystem::remove(path);
  std::filesystem::remove(back);
}

TEST(FuzzReaders, ThresholdTable) {
  const std::string path = temp_path("thr"), back = temp_path("thr_back");
  const std::string seed = thresholds_seed(path);
  fuzz("ThresholdTable.load", seed, 6000, true, 2, [&](const std::string& input) {
    write_bytes(path, input);
    const ThresholdTable t = ThresholdTable::load(path);
    std::filesystem::remove(back);
    t.save(back);
    const ThresholdTable r = ThresholdTable::load(back);
    EXPECT_EQ(r.budgets, t.budgets);
    EXPECT_EQ(std::vector<std::int64_t>({r.n_layers, r.n_heads, r.n_qtiles}),
              std::vector<std::int64_t>({t.n_layers, t.n_heads, t.n_qtiles}));
    EXPECT_EQ(r.model, t.model);
    ASSERT_EQ(r.values.size(), t.values.size());
    EXPECT_EQ(std::memcmp(r.values.data(), t.values.data(), t.values.size() * sizeof(float)), 0);
    for (std::size_t i = 0; i < t.budgets.size(); ++i) EXPECT_EQ(t.budget_index(t.budgets[i]), std::int64_t(i));
    (void)t.at(t.budgets.size() - 1, t.n_layers - 1, t.n_heads - 1, t.n_qtiles + 5);
  });
  std::filesystem::remove(path);
  std::filesystem::remove(back);
}

// JSON text read from a file (a header, or JSON inside a metadata string): whatever the pre-scan lets
// through, nlohmann parses, prints and copies in bounded stack.
TEST(FuzzReaders, JsonText) {
  const std::string seed =
      R"({"needles": [{"b": 0, "group": 1, "q_tile": 7, "kv_block": 2, "keys": [256, 272]}], "x": "\u00e9\n", "n": -1.5e3})";
  fuzz("JSON text", seed, 20000, false, 3, [&](const std::string& input) {
    const std::string fault = detail::untrusted_json_fault(input, 8);
    if (!fault.empty()) throw Error("json", "text", fault);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(input);
    } catch (const nlohmann::json::exception& e) {
      throw Error("json", "text", detail::printable(e.what(), 200));
    }
    const nlohmann::json copy = j;
    EXPECT_EQ(nlohmann::json::parse(copy.dump()), j);
  });
}

}  // namespace
}  // namespace sparse_attn
