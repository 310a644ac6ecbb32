// Device workspaces cached per (device, stream) for entry points that need scratch memory but take
// none from the caller. A workspace is never freed: the entry points reuse it across calls, and
// freeing at exit could run after the CUDA runtime has shut down. Each user keeps a cache of its own,
// so the contents one operator leaves (counters it expects at zero, say) are never touched by another.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace sparse_attn::cuda_backend {

class WorkspaceCache {
 public:
  /// The workspace of (device, stream), grown to at least `need` bytes; a new buffer's contents are
  /// undefined. Growth waits for the stream when there is an old buffer (earlier calls may still use
  /// it), then frees and allocates. Errors name `op`. The caller holds mutex() from this call through
  /// its launches, so two host threads sharing a stream never interleave their use of it.
  void* get(const std::string& op, int device, void* stream, std::size_t need);
  /// The workspace of (device, stream) if it holds at least `need` bytes, else null; never allocates.
  /// (Also under mutex().)
  void* find(int device, void* stream, std::size_t need) const;
  std::mutex& mutex() { return mutex_; }

 private:
  struct Entry {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  std::mutex mutex_;
  std::map<std::pair<int, void*>, Entry> entries_;
};

}  // namespace sparse_attn::cuda_backend
