// The one exception type of the library.
//
// Every bad input is reported by throwing `sparse_attn::Error`. Its message names the operator,
// the argument and, for selections, the first offending coordinate, e.g.
//   tile_sparse: argument 'tiles.idx': block id 40 at [0, 0, 3, 2] is out of range [0, 32)
#pragma once

#include <stdexcept>
#include <string>

namespace sparse_attn {

class Error : public std::runtime_error {
 public:
  Error(std::string op, std::string argument, const std::string& message);

  /// The operator that rejected its input ("tile_sparse", "pooled_select", ...).
  const std::string& op() const noexcept { return op_; }
  /// The argument at fault ("q", "tiles.idx", "options.alpha", ...); empty when none applies.
  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string op_;
  std::string argument_;
};

}  // namespace sparse_attn
