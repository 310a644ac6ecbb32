#include "common.hpp"

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <array>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <stdexcept>

#include "core/cpu.hpp"

namespace sparse_attn::cli {

namespace {
const auto g_start = std::chrono::steady_clock::now();
}

double Rng::normal() {
  const double u1 = std::max(uniform(), 1e-300), u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

CLI::Validator finite_range(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double x = 0.0;
        if (!CLI::detail::lexical_cast(text, x) || !std::isfinite(x) || x < lo || x > hi)
          return fmt::format("value {} is not a finite number in [{}, {}]", text, lo, hi);
        return {};
      },
      fmt::format("FINITE in [{} - {}]", lo, hi));
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::uint64_t x = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
        if (text.empty() || ec != std::errc() || end != text.data() + text.size())
          return fmt::format("value {} is not an integer in [0, 2^64)", text);
        return {};
      },
      "UINT64");
}

void check_memory(double bytes, const std::string& options) {
  const double physical = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  if (physical > 0.0 && bytes > physical)
    throw std::runtime_error(fmt::format("{} ask for {:.3g} GiB, more than the {:.1f} GiB of memory of this machine",
                                         options, bytes / kGiB, physical / kGiB));
}

Placement Placement::choose(const std::string& flag) {
  Placement p;
  p.name = fmt::format("CPU ({} threads)", build_info().cpu_threads);
  if (flag == "cpu") return p;
  const bool want_cuda = flag == "cuda";
  if (!want_cuda && flag != "auto")
    throw std::runtime_error("--device must be auto, cpu or cuda, got '" + flag + "'");
  if (!cuda_compiled()) {
    if (want_cuda) throw std::runtime_error("--device cuda: this program was built without the CUDA backend");
    return p;
  }
  for (const auto& d : cuda_devices()) {
    if (!d.supported) continue;
    p.cuda = true;
    p.index = d.index;
    p.name = fmt::format("{} (cuda:{}, sm_{}{})", d.name, d.index, d.major, d.minor);
    return p;
  }
  if (want_cuda) throw std::runtime_error("--device cuda: no supported CUDA device (the kernels need sm_90)");
  return p;
}

std::string Placement::banner() const {
  return cuda ? "running on GPU: " + name : "running on CPU: no supported CUDA device" +
                                               std::string(cuda_compiled() ? "" : " (built without CUDA)") + ", " + name;
}

bool is_missing_implementation(const Error& e) {
  return std::string(e.what()).find("no cuda implementation of") != std::string::npos;
}

Mirrored::Mirrored(DType dtype, std::vector<std::int64_t> shape, const Placement& where)
    : host_(dtype, std::move(shape)), device_index_(where.index) {}

Mirrored::Mirrored(HostTensor host, const Placement& where) : host_(std::move(host)), device_index_(where.index) {}

TensorView Mirrored::view(bool device) {
  if (!device) return host_.view();
  if (!dev_) {
    dev_.emplace(host_.dtype(), host_.shape(), device_index_);
    dev_->upload(host_.view());
  }
  return dev_->view();
}

void Mirrored::upload() {
  if (!dev_) dev_.emplace(host_.dtype(), host_.shape(), device_index_);
  dev_->upload(host_.view());
}

void Mirrored::download() {
  if (dev_) dev_->download(host_.view());
}

void Mirrored::poison() {
  std::memset(host_.view().data, 0xff, static_cast<std::size_t>(host_.numel()) * dtype_size(host_.dtype()));
  if (dev_) dev_->fill_bytes(0xff);
}

double elapsed_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - g_start).count();
}

double time_ms(bool device, const std::function<void()>& f) {
  if (device) return device_time_ms(f);
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

namespace {
double element(const TensorView& t, std::int64_t i) {
  const char* p = static_cast<const char*>(t.data) + i * static_cast<std::int64_t>(dtype_size(t.dtype));
  return detail::load_float(t, p);
}
}  // namespace

double relative_error(const TensorView& a, const TensorView& b) {
  if (a.ndim != b.ndim || a.shape != b.shape) throw std::runtime_error("relative_error: shapes differ");
  // Walks the coordinates, so strided views (a slice of queries) work.
  std::array<std::int64_t, kMaxDims> idx{};
  const std::int64_t n = a.numel();
  double num = 0.0, den = 0.0;
  for (std::int64_t e = 0; e < n; ++e) {
    std::int64_t oa = 0, ob = 0;
    for (int d = 0; d < a.ndim; ++d) {
      oa += idx[d] * a.stride[d];
      ob += idx[d] * b.stride[d];
    }
    const double x = element(a, oa), y = element(b, ob);
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
    for (int d = a.ndim - 1; d >= 0 && ++idx[d] == a.shape[d]; --d) idx[d] = 0;
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool all_finite(const TensorView& t) {
  for (std::int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(element(t, i))) return false;
  return true;
}

double median(std::vector<double> v) {
  if (v.empty()) throw std::runtime_error("median of an empty list");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string iso8601_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

nlohmann::json build_json(const Placement& where) {
  const auto info = build_info();
  return {
      {"date", iso8601_now()},
      {"device", where.name},
      {"device_kind", where.cuda ? "cuda" : "cpu"},
      {"build",
       {{"version", info.version},
        {"compiler", info.compiler},
        {"cuda_backend", info.cuda},
        {"cuda_version", info.cuda_version},
        {"cuda_archs", info.cuda_archs},
        {"cpu_threads", info.cpu_threads}}},
  };
}

void check_writable(const std::string& path) {
  std::ofstream f(path, std::ios::app);
  if (!f) throw std::runtime_error("cannot open '" + path + "' for writing");
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot open '" + path + "' for writing");
  f << j.dump(2) << '\n';
  if (!f) throw std::runtime_error("error writing '" + path + "'");
}

}  // namespace sparse_attn::cli
