#!/usr/bin/env bash
# Copies the headers, libraries and CMake configs of the Debian packages that the GPU machine lacks (GoogleTest,
# nlohmann-json, CLI11, fmt) into .gpu/usr, the git-ignored prefix that scripts/gpu_run.sh and dev/gpu/ab.sh
# pass to CMake there (carry ".gpu" with the run). Installs the packages here first where they are missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$ROOT/scripts/common.sh"
PKGS=(libgtest-dev nlohmann-json3-dev libcli11-dev libfmt-dev)
install_system_packages "${PKGS[@]}"
DEST="$ROOT/.gpu/usr"
mkdir -p "$DEST"
for p in "${PKGS[@]}" googletest "$(dpkg-query -W -f='${Depends}' libfmt-dev | grep -o 'libfmt[0-9]*' | head -1)"; do
  dpkg -L "$p" 2>/dev/null | grep -E '^/usr/(include|lib|share/cmake)/' || true
done | while read -r f; do
  if [ -f "$f" ] || [ -L "$f" ]; then
    d="$DEST/${f#/usr/}"
    mkdir -p "$(dirname "$d")"
    cp -a "$f" "$d"
  fi
done
du -sh "$DEST"
