"""The package's top level: the product API and nothing else, and no name there that hides a submodule by accident."""

import pkgutil

import kernels

PRODUCT_API = {"runtime", "describe", "rms_norm", "TritonRMSNorm", "cross_entropy", "TritonCrossEntropyLoss",
               "linear_cross_entropy", "TritonLinearCrossEntropyLoss", "swiglu", "TritonSwiGLUMLP", "apply_rotary",
               "patch_llama", "LlamaPatch", "TritonAdamW", "flash_attention"}


def test_top_level_is_the_product_api():
    assert set(kernels.__all__) == PRODUCT_API
    for name in PRODUCT_API:
        assert getattr(kernels, name) is not None


def test_only_the_losses_name_a_function_and_a_module():
    submodules = {m.name for m in pkgutil.iter_modules(kernels.__path__)}
    shadowed = {name for name in submodules if name in vars(kernels) and not hasattr(vars(kernels)[name], "__path__")
                and type(vars(kernels)[name]).__name__ != "module"}
    assert shadowed == {"cross_entropy", "linear_cross_entropy", "swiglu"}
    for name in shadowed:
        assert callable(getattr(kernels, name)) and getattr(kernels, name).__module__ == f"kernels.{name}"
