# The workbook inside the NVIDIA PyTorch (NGC) container, as used on DGX Station and other NVIDIA systems.
# The base image is pinned; its torch and Triton are built for its CUDA and for current GPUs (Hopper, Blackwell),
# so they are kept exactly as they are: the torch and triton lines of requirements.txt are skipped.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/workbook

COPY requirements.txt .
RUN torch_before="$(python -c 'import torch, triton; print(torch.__version__, triton.__version__)')" \
 && grep -vE '^[[:space:]]*(torch|triton)([=<>!~ ]|$)' requirements.txt > /tmp/requirements-container.txt \
 && python -m pip install --no-cache-dir -r /tmp/requirements-container.txt \
 && torch_after="$(python -c 'import torch, triton; print(torch.__version__, triton.__version__)')" \
 && echo "torch/triton kept: ${torch_after}" \
 && test "${torch_before}" = "${torch_after}"

COPY . .
RUN python -m pip install --no-cache-dir --no-deps -e .

# Models and tokenizers you already have are found through the mounted Hugging Face cache (see README.md).
ENV HF_HOME=/root/.cache/huggingface
EXPOSE 8888
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "--ServerApp.root_dir=/workspace/workbook"]
