#include "sparse_attn/error.hpp"

#include <utility>

namespace sparse_attn {
namespace {
std::string compose(const std::string& op, const std::string& argument, const std::string& message) {
  std::string s = op;
  if (!argument.empty()) s += ": argument '" + argument + "'";
  return s + ": " + message;
}
}  // namespace

Error::Error(std::string op, std::string argument, const std::string& message)
    : std::runtime_error(compose(op, argument, message)), op_(std::move(op)), argument_(std::move(argument)) {}

}  // namespace sparse_attn
