#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine (idempotent), builds everything and runs every test: the C++
# suites and CLI checks through ctest (the GPU suites skip without a supported GPU), then the Python
# package is installed into the active python3 and its tests run with pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

start=$(date +%s)
install_system_packages "${SYSTEM_PACKAGES[@]}"
setup_python
configure_and_build

log "ctest"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"

log "pip install . (Python package)"
cd "$REPO_ROOT"
# The build dependencies were installed above; building without isolation reuses them offline.
python3 -m pip install --no-build-isolation .

log "pytest tests/python"
# Run from outside the source tree so that the installed package, not python/, is imported.
(cd "$BUILD_DIR" && python3 -m pytest -q "$REPO_ROOT/tests/python")

log "all tests passed in $(( $(date +%s) - start )) s"
