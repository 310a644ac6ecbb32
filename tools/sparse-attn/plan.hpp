// sparse-attn plan: the planner's statistics, estimates and decision for synthetic per-query lists.
#pragma once

#include <CLI/CLI.hpp>

namespace sparse_attn::cli {

/// Adds the `plan` subcommand to `app`; it runs from its own callback and exits with status 2 on a
/// library error.
void add_plan_command(CLI::App& app);

}  // namespace sparse_attn::cli
