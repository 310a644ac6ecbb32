#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (idempotent), builds the sparse-attn program and runs its demo:
# selectors -> executors on a synthetic long-context workload, against dense attention.
# Extra arguments go to `sparse-attn demo` (e.g. --len 8192 --budget 12 --json demo.json).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

install_system_packages "${SYSTEM_PACKAGES[@]}"
configure_and_build sparse-attn

log "sparse-attn info"
"$BUILD_DIR/tools/sparse-attn" info
log "sparse-attn demo $*"
"$BUILD_DIR/tools/sparse-attn" demo "$@"
