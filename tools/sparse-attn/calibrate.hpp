// sparse-attn calibrate: gated's thresholds (docs/design.md §5.5) from calibration samples saved as
// safetensors files, on the CPU or the GPU, written as a ThresholdTable file.
#pragma once

#include <CLI/CLI.hpp>

namespace sparse_attn::cli {

/// Adds the `calibrate` subcommand to `app`; it runs from its own callback and exits with status 2 on
/// a library error.
void add_calibrate_command(CLI::App& app);

}  // namespace sparse_attn::cli
