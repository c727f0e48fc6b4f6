"""Shared test set-up: `gpu`-marked tests run only where CUDA is present; each test gets fresh random inputs."""

import pytest
import torch

import kernels  # noqa: F401  (sets the runtime mode before any kernel is defined)
from kernels import runtime


def pytest_collection_modifyitems(config, items):
    if runtime.MODE == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this run uses the Triton interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return runtime.device()


@pytest.fixture
def gen(device):
    """A random generator seeded differently on every run: the kernels must be right for any input, not one."""
    g = torch.Generator(device="cpu")
    g.seed()
    return g
