# The workbook inside the NVIDIA PyTorch (NGC) container, as used on DGX Station (GB300, ARM64 Grace) and other
# NVIDIA systems. Build and check it with scripts/docker-build.sh; README.md ("In the NVIDIA PyTorch container") has
# the `docker run` line.
#
# The base image: 26.07. NVIDIA's DGX playbooks ask for 26.01 or later for Triton's Blackwell support; the workbook's
# GPU runs use torch 2.11 and its CPU runs torch 2.13. As reported by projects that pin these tags: 26.02 ships
# torch 2.11.0a0 (nv26.02), 26.04 and 26.05 torch 2.12 (CUDA 13.2), 26.07 torch 2.13.0a0+9186a08b2c.nv26.07 (run on
# GB300 stations). The image is multi-architecture (amd64 and arm64); Python 3.12, Ubuntu 24.04.
# Its torch and Triton are built for its CUDA and for Hopper and Blackwell, so they are kept exactly as they are.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.07-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/workbook

# The requirements, under the image's pip constraints. Since 25.03 the NGC PyTorch images pin every Python package
# they ship in /etc/pip/constraint.txt (PIP_CONSTRAINT points to it; NVIDIA's release notes describe it), so that an
# install cannot replace the tested torch, Triton, numpy, transformers, ... The install below honours that file: it
# is passed explicitly (and must exist), the torch and triton lines are left out (the image's own builds stay), and
# any package whose version the install would change makes the build fail, listed by name. A requirement that
# cannot be met under the constraints fails the build too, instead of being forced in.
COPY requirements.txt .
RUN set -eu; \
    constraint="${PIP_CONSTRAINT:-/etc/pip/constraint.txt}"; \
    test -s "$constraint" || { echo "no pip constraints file at $constraint" >&2; exit 1; }; \
    grep -vE '^[[:space:]]*(torch|triton)([=<>!~ ;[]|$)' requirements.txt > /tmp/requirements-container.txt; \
    python -m pip freeze --all | sort > /tmp/before.txt; \
    python -m pip install --no-cache-dir --constraint "$constraint" -r /tmp/requirements-container.txt; \
    python -m pip freeze --all | sort > /tmp/after.txt; \
    changed="$(comm -23 /tmp/before.txt /tmp/after.txt | cut -d= -f1)"; \
    if [ -n "$changed" ]; then echo "the install changed packages of the image: $changed" >&2; exit 1; fi; \
    python -m pip check || echo "pip check found the conflicts above (the base image's own packages included)"

COPY . .
# Editable: with the checkout mounted on /workspace/workbook, `import kernels` is the mounted code. No build
# isolation, so the image's own (constrained) setuptools builds it.
RUN python -m pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && { python -c 'import sys, torch, triton; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda); print("triton", triton.__version__)'; \
      python -m pip freeze --all; } > /workspace/workbook-versions.txt \
 && mkdir -p /workspace/hf-cache /workspace/workbook/.cache/home \
 && chmod 1777 /workspace/hf-cache /workspace/workbook/.cache /workspace/workbook/.cache/home

# Caches that outlive the container: kept in the mounted checkout (.cache/, ignored by git), so the second
# container starts warm. Triton's compiled kernels, the C++/CUDA extensions (kernels/prebuild.py builds them all),
# torch.compile's. HOME too: with `docker run --user` (README.md) the user has no home in the image, and Jupyter,
# matplotlib and pip write under it.
ENV TRITON_CACHE_DIR=/workspace/workbook/.cache/triton \
    TORCH_EXTENSIONS_DIR=/workspace/workbook/.cache/torch_extensions \
    TORCHINDUCTOR_CACHE_DIR=/workspace/workbook/.cache/inductor \
    HOME=/workspace/workbook/.cache/home \
    HF_HOME=/workspace/hf-cache
# The image sets TORCH_CUDA_ARCH_LIST to every architecture its PyTorch supports, so an extension built in it
# compiles once per architecture (six of them). Cleared, the workbook's CUDA extension compiles for the GPU in this machine only
# (kernels/cuda_rmsnorm.py); `docker run -e TORCH_CUDA_ARCH_LIST=...` still chooses.
ENV TORCH_CUDA_ARCH_LIST=

EXPOSE 8888
# Listens on every interface inside the container; `-p 127.0.0.1:8888:8888` (README.md) publishes it on the host's
# loopback only. --allow-root: for a run without --user.
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "--ServerApp.root_dir=/workspace/workbook"]
