"""The package's top level: the product API and nothing else, and no name there that hides a submodule by accident."""

import pkgutil

import kernels

PRODUCT_API = {"runtime", "describe", "rms_norm", "TritonRMSNorm", "cross_entropy", "TritonCrossEntropyLoss",
               "swiglu", "TritonSwiGLUMLP", "apply_rotary", "patch_llama", "LlamaPatch"}


def test_top_level_is_the_product_api():
    assert set(kernels.__all__) == PRODUCT_API
    for name in PRODUCT_API:
        assert getattr(kernels, name) is not None


def test_only_cross_entropy_and_swiglu_name_a_function_and_a_module():
    submodules = {m.name for m in pkgutil.iter_modules(kernels.__path__)}
    shadowed = {name for name in submodules if name in vars(kernels) and not hasattr(vars(kernels)[name], "__path__")
                and type(vars(kernels)[name]).__name__ != "module"}
    assert shadowed == {"cross_entropy", "swiglu"}
    assert callable(kernels.cross_entropy) and kernels.cross_entropy.__module__ == "kernels.cross_entropy"
    assert callable(kernels.swiglu) and kernels.swiglu.__module__ == "kernels.swiglu"
