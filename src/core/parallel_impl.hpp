#pragma once

#include <exception>
#include <mutex>

namespace sparse_attn::detail {

template <class F>
void parallel_for(std::int64_t n, F&& f) {
  std::exception_ptr error;
  std::mutex error_mutex;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1)
#endif
  for (std::int64_t i = 0; i < n; ++i) {
    try {
      f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace sparse_attn::detail
