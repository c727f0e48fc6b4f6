#!/usr/bin/env bash
# Build the workbook's container image and check it: the smoke check imports `kernels` inside the image and prints
# where it runs and with which versions (kernels.describe()), and the versions the build recorded.
#
#     scripts/docker-build.sh                       # image llm-kernel-workbook, on the Dockerfile's base image
#     IMAGE=my-workbook BASE_IMAGE=nvcr.io/nvidia/pytorch:26.08-py3 scripts/docker-build.sh
#     PREBUILD=1 scripts/docker-build.sh            # also compile the C++/CUDA extensions once (python -m kernels.prebuild)
#     GPU_FLAGS= scripts/docker-build.sh            # on a machine without GPUs (or without the NVIDIA container toolkit)
#
# Works on x86-64 and on ARM64 hosts (DGX Station, DGX Spark): the base image is multi-architecture and nothing in
# the Dockerfile is specific to one CPU. Exit status 0 when the image builds and the smoke check passes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-llm-kernel-workbook}"
GPU_FLAGS="${GPU_FLAGS---gpus all}"
build_args=()
if [ -n "${BASE_IMAGE:-}" ]; then build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE"); fi

echo "== docker build -t $IMAGE ($(uname -m) host)"
docker build "${build_args[@]}" -t "$IMAGE" "$ROOT"

# The smoke check runs as the calling user, with the checkout mounted, as README.md's `docker run` does.
# shellcheck disable=SC2086  # GPU_FLAGS is a list of flags, or empty
run=(docker run --rm $GPU_FLAGS --ipc=host --ulimit memlock=-1 --ulimit stack=67108864
     --user "$(id -u):$(id -g)" -v "$ROOT":/workspace/workbook "$IMAGE")

echo "== smoke check"
"${run[@]}" python - <<'PY'
import os

import torch
import triton
import transformers

import kernels

print(kernels.describe())
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}")
print("kernels from", os.path.dirname(kernels.__file__))
for name in ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "HOME", "HF_HOME", "TORCH_CUDA_ARCH_LIST", "PIP_CONSTRAINT"):
    print(f"{name}={os.environ.get(name, '')}")
x = torch.randn(4, 64, device="cuda" if torch.cuda.is_available() else "cpu")
w = torch.rand(64, device=x.device) + 0.5
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
err = ((kernels.rms_norm(x, w, 1e-6) - ref).norm() / ref.norm()).item()
print(f"rms_norm against PyTorch: relative error {err:.1e}")
assert err < 1e-5, err
PY
"${run[@]}" sh -c 'head -4 /workspace/workbook-versions.txt'

if [ "${PREBUILD:-0}" = "1" ]; then
  echo "== python -m kernels.prebuild (into the mounted checkout's .cache/)"
  "${run[@]}" python -m kernels.prebuild
fi
echo "== $IMAGE is ready: see README.md for the docker run line"
