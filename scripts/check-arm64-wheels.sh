#!/usr/bin/env bash
# Do the workbook's requirements have wheels for Linux on ARM64 (aarch64: DGX Station's and DGX Spark's Grace CPU)?
#
#     scripts/check-arm64-wheels.sh                 # Python 3.12, the NGC PyTorch container's
#     PYTHON_VERSION=3.11 scripts/check-arm64-wheels.sh
#
# Runs on any machine with pip and network access to PyPI (no ARM64 machine, no Docker needed). Two checks:
#   1. `pip download --only-binary=:all:` of each requirement of requirements.txt (minus torch and triton, which the
#      container keeps as its own) for aarch64 Linux: a requirement without an aarch64 (or pure-Python) wheel fails
#      here instead of trying to compile on the station;
#   2. the whole dependency tree resolved for aarch64 without downloading it (`pip install --dry-run`, metadata only),
#      which names any dependency of a dependency that has no such wheel.
# glibc: the container is Ubuntu 24.04 (glibc 2.39), so wheels tagged manylinux2014 (glibc 2.17) up to
# manylinux_2_39 are accepted. Exit status 0 when every wheel exists.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

PLATFORMS=(--platform manylinux2014_aarch64)
for minor in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${minor}_aarch64"); done
WHEEL_ONLY=(--only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp "${PLATFORMS[@]}")

# The requirement lines, without comments, blank lines, torch and triton (the same filter as the Dockerfile's).
grep -vE '^[[:space:]]*(#|$)' "$ROOT/requirements.txt" \
  | grep -vE '^[[:space:]]*(torch|triton)([=<>!~ ;[]|$)' > "$WORK/requirements.txt"

echo "aarch64 wheels for Python $PYTHON_VERSION, $(wc -l < "$WORK/requirements.txt") requirements (torch and triton left to the container):"
missing=()
while read -r requirement; do
  if "$PYTHON" -m pip download --quiet --no-deps --dest "$WORK/wheels" "${WHEEL_ONLY[@]}" "$requirement" \
       > "$WORK/log" 2>&1; then
    printf '  ok       %s\n' "$requirement"
  else
    printf '  MISSING  %s\n' "$requirement"
    sed 's/^/           /' "$WORK/log" | tail -3
    missing+=("$requirement")
  fi
done < "$WORK/requirements.txt"
echo "wheels downloaded:"
ls "$WORK/wheels" | sed 's/^/  /'

echo "the whole tree, resolved for aarch64 (metadata only; torch and its CUDA libraries appear because peft and"
echo "accelerate depend on torch: in the container the image's own torch satisfies them):"
if "$PYTHON" -m pip install --quiet --dry-run --ignore-installed --target "$WORK/target" "${WHEEL_ONLY[@]}" \
     --report "$WORK/report.json" -r "$WORK/requirements.txt" > "$WORK/log" 2>&1; then
  "$PYTHON" - "$WORK/report.json" <<'PY'
import json, sys
install = json.load(open(sys.argv[1]))["install"]
print(f"  {len(install)} distributions resolve, every one with a wheel:")
for item in sorted(install, key=lambda i: i["metadata"]["name"].lower()):
    print(f"    {item['metadata']['name']} {item['metadata']['version']}  {item['download_info']['url'].rsplit('/', 1)[-1]}")
PY
else
  echo "  the tree does not resolve with wheels only:"
  sed 's/^/    /' "$WORK/log" | tail -15
  missing+=("(dependency tree)")
fi

if ((${#missing[@]})); then
  echo "no aarch64 wheel: ${missing[*]}"
  exit 1
fi
echo "every requirement has an aarch64 wheel"
