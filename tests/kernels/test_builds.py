"""The just-in-time C++/CUDA builds: one line before a build that compiles and none when the cache is warm, the GPU
architectures a CUDA build compiles for, `python -m kernels.prebuild`, and the CUDA kernels' launch bounds against
the blocks the host code launches.

Nothing here compiles except `test_prebuild_on_this_machine` (the CPU extension, which
tests/kernels/test_cuda_rmsnorm.py builds in the same session anyway) and the GPU-marked register check: the builds
are PyTorch's `load`, replaced by a stand-in that writes the library file it would have written."""

import os
import re
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from kernels import cuda_rmsnorm, host_path, prebuild, runtime

ROOT = Path(__file__).resolve().parents[2]
CUDA_SOURCE = ROOT / "kernels" / "csrc" / "rmsnorm_cuda.cu"


# --------------------------------------------------------------------------------------------------------------------
# Which architectures a CUDA build compiles for
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env_value", [None, "", "  ", "native"])
def test_without_the_variable_the_build_is_for_this_machines_gpus(env_value):
    assert host_path.cuda_arch_list(env_value, [(9, 0)]) == ("9.0", "this machine's GPU")
    # two kinds of GPU: both, each once, in order
    assert host_path.cuda_arch_list(env_value, [(12, 1), (9, 0), (12, 1)])[0] == "9.0;12.1"
    assert host_path.cuda_arch_list(env_value, [(10, 3)])[0] == "10.3"  # GB300: sm_103


def test_the_variable_overrides_the_gpus():
    assert host_path.cuda_arch_list("9.0;10.0+PTX", [(12, 0)]) == ("9.0;10.0+PTX", "TORCH_CUDA_ARCH_LIST")
    assert host_path.cuda_arch_list(" 12.1 ", []) == ("12.1", "TORCH_CUDA_ARCH_LIST")  # no GPU needed


def test_no_gpu_and_no_variable_is_refused_by_name():
    with pytest.raises(ValueError, match="no GPU found and TORCH_CUDA_ARCH_LIST is not set"):
        host_path.cuda_arch_list(None, [])


def test_arch_names_as_nvcc_spells_them():
    assert host_path.arch_names("9.0;10.3+PTX") == "sm_90, sm_103 (+PTX)"
    assert host_path.split_arch_list("7.5 8.0,9.0;;") == ["7.5", "8.0", "9.0"]


def test_the_cuda_build_asks_every_gpu(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(10, 3), (9, 0)][i])
    assert cuda_rmsnorm.cuda_build_arch_list() == ("9.0;10.3", "this machine's GPU")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "12.0")
    assert cuda_rmsnorm.cuda_build_arch_list() == ("12.0", "TORCH_CUDA_ARCH_LIST")


@pytest.mark.parametrize("before", [None, "8.0;9.0"])
def test_the_variable_is_set_for_the_build_only(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", before)
    with host_path.arch_list_set("12.1"):
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "12.1"
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") == before
    with pytest.raises(RuntimeError), host_path.arch_list_set("10.0"):
        raise RuntimeError("a failed build")
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") == before


# --------------------------------------------------------------------------------------------------------------------
# One line before a build that compiles, nothing when the cache is warm
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_load(monkeypatch, tmp_path):
    """PyTorch's `load` replaced: it records each call (and TORCH_CUDA_ARCH_LIST during it) and writes the library
    into the build folder, as a real build would. Extensions are built under a fresh TORCH_EXTENSIONS_DIR."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    calls = []

    def load(name, sources, build_directory=None, **options):
        folder = host_path.build_directory_for(name, build_directory)
        folder.mkdir(parents=True, exist_ok=True)
        library = folder / f"{name}.so"
        library.write_bytes(b"a library")
        calls.append({"name": name, "arch": os.environ.get("TORCH_CUDA_ARCH_LIST"), **options})
        return str(library)

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_a_cold_build_says_so_once_and_a_warm_one_says_nothing(fake_load, tmp_path, capsys):
    source = tmp_path / "ext.cpp"
    source.write_text("int f() { return 1; }\n")
    args = ("kernels_test_ext", [source], "a test extension", "about 9 s")
    host_path.load_announced(*args, extra_cflags=["-O2"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kernels: compiling a test extension (kernels/csrc/ext.cpp): not built yet here; "
                             "about 9 s, then cached in ")
    assert err[0].endswith(str(tmp_path / "extensions" / "kernels_test_ext"))

    host_path.load_announced(*args, extra_cflags=["-O2"], verbose=True)  # verbose builds the same thing
    assert capsys.readouterr().err == ""
    assert len(fake_load) == 2  # PyTorch's load still runs (it loads the cached library)

    source.write_text("int f() { return 2; }\n")  # an edited source compiles again, and says why
    host_path.load_announced(*args, extra_cflags=["-O2"])
    assert "its sources, flags or PyTorch changed since the last build" in capsys.readouterr().err
    host_path.load_announced(*args, extra_cflags=["-O3"])  # so do other flags
    assert "changed since the last build" in capsys.readouterr().err
    host_path.load_announced(*args, extra_cflags=["-O3"])
    assert capsys.readouterr().err == ""


def test_a_library_built_before_keys_were_kept(fake_load, tmp_path, capsys):
    source = tmp_path / "ext.cpp"
    source.write_text("int f() { return 1; }\n")
    folder = tmp_path / "extensions" / "kernels_test_old"
    folder.mkdir(parents=True)
    library = folder / "kernels_test_old.so"
    library.write_bytes(b"an older build")
    os.utime(source, (1e9, 1e9))  # the library is newer than its source: warm, nothing to say
    host_path.load_announced("kernels_test_old", [source], "an old extension", "about 1 s")
    assert capsys.readouterr().err == ""
    (folder / "kernels-build.key").unlink()
    os.utime(library, (1e9 - 10, 1e9 - 10))  # older than its source: it compiles, and says so
    host_path.load_announced("kernels_test_old", [source], "an old extension", "about 1 s")
    assert "kernels: compiling an old extension" in capsys.readouterr().err


def test_a_failed_build_leaves_the_cache_cold(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))

    def fail(name, sources, build_directory=None, **options):
        raise RuntimeError("Error building extension")

    monkeypatch.setattr(cpp_extension, "load", fail)
    source = tmp_path / "ext.cpp"
    source.write_text("broken")
    for _ in range(2):  # announced again on the next try: nothing was cached
        with pytest.raises(RuntimeError):
            host_path.load_announced("kernels_test_fail", [source], "a broken extension", "about 1 s")
        assert capsys.readouterr().err.count("kernels: compiling a broken extension") == 1


def test_the_cuda_build_names_its_architectures(fake_load, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5 8.0 8.6 9.0 10.0 12.0+PTX")  # as a container may set it
    info = cuda_rmsnorm._build("kernels_test_cuda", [CUDA_SOURCE], False, None, "the CUDA test", "about 60 s",
                               arch_list="12.1", extra_cuda_cflags=cuda_rmsnorm.CUDA_FLAGS)
    assert fake_load[-1]["arch"] == "12.1"  # PyTorch's build saw the chosen architectures, and only those
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "7.5 8.0 8.6 9.0 10.0 12.0+PTX"  # restored
    assert info.compiled and info.arch_list == "12.1" and "for sm_121 in" in info.describe()
    assert capsys.readouterr().err.count("kernels: compiling the CUDA test (kernels/csrc/rmsnorm_cuda.cu)") == 1
    cuda_rmsnorm._build("kernels_test_cuda", [CUDA_SOURCE], False, None, "the CUDA test", "about 60 s",
                        arch_list="12.1", extra_cuda_cflags=cuda_rmsnorm.CUDA_FLAGS)
    assert capsys.readouterr().err == ""
    cuda_rmsnorm._build("kernels_test_cuda", [CUDA_SOURCE], False, None, "the CUDA test", "about 60 s",
                        arch_list="9.0", extra_cuda_cflags=cuda_rmsnorm.CUDA_FLAGS)
    assert "changed since the last build" in capsys.readouterr().err  # another GPU: another build


def test_build_cuda_announces_this_gpu(fake_load, monkeypatch, capsys):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(cuda_rmsnorm, "_BUILDS", {})
    monkeypatch.setattr(cuda_rmsnorm, "cuda_build_unavailable", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (10, 3))
    registered = []
    monkeypatch.setattr(torch.library, "register_fake", lambda name, fn: registered.append(name))
    info = cuda_rmsnorm.build_cuda()
    err = capsys.readouterr().err
    assert "kernels: compiling the CUDA C++ RMSNorm for sm_103 (this machine's GPU) (kernels/csrc/rmsnorm_cuda.cu)" \
        in err
    assert f"about {cuda_rmsnorm.CUDA_BUILD_SECONDS_PER_ARCH} s of one CPU core" in err
    assert info.arch_list == "10.3" and fake_load[-1]["arch"] == "10.3"
    assert registered == ["kernels_cuda::rms_norm_fwd", "kernels_cuda::rms_norm_bwd"]


def test_build_cpu_announces_itself(fake_load, monkeypatch, capsys):
    monkeypatch.setattr(cuda_rmsnorm, "_BUILDS", {})
    monkeypatch.setattr(cuda_rmsnorm, "cpu_build_unavailable", lambda: None)
    monkeypatch.setattr(torch.library, "register_fake", lambda name, fn: None)
    info = cuda_rmsnorm.build_cpu()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "compiling the C++ RMSNorm for the CPU (kernels/csrc/rmsnorm_cpu.cpp)" in err[0]
    assert f"about {cuda_rmsnorm.CPU_BUILD_SECONDS} s of one CPU core" in err[0]
    assert info.arch_list is None and fake_load[-1]["arch"] is None  # C++ only


def test_the_host_path_build_announces_itself(fake_load, monkeypatch, capsys):
    class Extension:
        def set_launcher(self, *args):
            self.launcher = args

    monkeypatch.setattr(cpp_extension, "load", lambda **kw: (fake_load.append(kw), Extension())[1])
    monkeypatch.setattr(host_path, "_state", {"ext": None, "reason": None, "seconds": None, "cols": None})
    ext = host_path._build()
    assert isinstance(ext, Extension) and fake_load[-1]["with_cuda"]
    err = capsys.readouterr().err
    assert "kernels: compiling the C++ host path of SwiGLU, RoPE and RMSNorm, C++ only (kernels/csrc/host_path.cpp)" \
        in err and f"about {host_path.HOST_PATH_BUILD_SECONDS} s" in err


# --------------------------------------------------------------------------------------------------------------------
# python -m kernels.prebuild
# --------------------------------------------------------------------------------------------------------------------


def test_prebuild_builds_what_it_can_and_says_what_it_skips():
    def broken():
        raise RuntimeError("the compiler said no\nError building extension 'x'")

    steps = [prebuild.Step("one", lambda: None, lambda: "built"),
             prebuild.Step("two", lambda: "no CUDA GPU here", lambda: pytest.fail("built a skipped step")),
             prebuild.Step("three", lambda: None, broken)]
    out = StringIO()
    assert prebuild.prebuild(steps, out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("ready    one (") and lines[0].endswith("): built")
    assert lines[1] == "skipped  two: no CUDA GPU here"
    assert lines[2] == "FAILED   three: RuntimeError: Error building extension 'x'"


def test_prebuild_names_the_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert prebuild.caches() == [f"C++ extensions: {tmp_path / 'ext'} (TORCH_EXTENSIONS_DIR)",
                                 f"Triton kernels: {tmp_path / 'triton'} (TRITON_CACHE_DIR)"]


def test_prebuild_on_this_machine(capsys):
    code = prebuild.main([])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == runtime.describe()
    if cuda_rmsnorm.cpu_build_unavailable() is None:
        assert "ready    C++ RMSNorm for the CPU (chapter 13)" in out
    if runtime.MODE != "gpu":
        assert "skipped  CUDA C++ RMSNorm (chapter 13): no CUDA GPU here" in out
        assert "skipped  C++ host path of SwiGLU, RoPE and RMSNorm: no GPU" in out
    assert code == (1 if "FAILED" in out else 0) and "FAILED" not in out
    assert "(TORCH_EXTENSIONS_DIR)" in out and "(TRITON_CACHE_DIR)" in out


# --------------------------------------------------------------------------------------------------------------------
# The CUDA kernels' __launch_bounds__ against the blocks the host launches
# --------------------------------------------------------------------------------------------------------------------


def _source() -> str:
    return re.sub(r"//[^\n]*", "", CUDA_SOURCE.read_text())  # code only


def _constants(source: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for name, expression in re.findall(r"constexpr int (\w+) = ([^;]+);", source):
        for known, value in values.items():
            expression = re.sub(rf"\b{known}\b", str(value), expression)
        if re.fullmatch(r"[\d\s*+()-]+", expression):  # integer arithmetic on constants defined above
            values[name] = int(eval(expression))
    return values


def _kernel_bounds(source: str) -> dict[str, str]:
    """Each __global__ kernel's __launch_bounds__ argument (a constant's name), by kernel name."""
    kernels = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\((\w+)\)\s+)?(\w+)\s*\(", source)
    assert len(kernels) == 4, kernels
    return {name: bound for bound, name in kernels}


def _launches(source: str) -> list[tuple[str, str, str]]:
    """(kernel, block expression, the statement's function body up to the launch) of each <<<...>>> launch."""
    aliases = dict((alias, name) for alias, name in re.findall(r"const auto (\w+) = (\w+)<", source))
    found = []
    for m in re.finditer(r"(\w+)(?:<[^<>;]*>)?<<<([^,]+),\s*([^,]+),", source):
        kernel = aliases.get(m.group(1), m.group(1))
        found.append((kernel, m.group(3).strip(), source[:m.start()]))
    return found


def test_every_kernel_states_its_largest_block():
    source = _source()
    bounds = _kernel_bounds(source)
    assert all(bounds.values()), f"kernels without __launch_bounds__: {[k for k, b in bounds.items() if not b]}"
    constants = _constants(source)
    for kernel, bound in bounds.items():
        assert constants[bound] % 32 == 0 and 32 <= constants[bound] <= 1024, (kernel, bound)


def test_no_launch_exceeds_the_kernels_bound():
    source = _source()
    bounds, constants = _kernel_bounds(source), _constants(source)
    launches = _launches(source)
    assert {k for k, _, _ in launches} == set(bounds), launches  # every kernel launched, and only these
    for kernel, threads, before in launches:
        bound = bounds[kernel]
        if threads in constants:  # a fixed block: the bound itself, or smaller
            assert constants[threads] <= constants[bound], (kernel, threads, bound)
            continue
        # a computed block: the last assignment of that variable before the launch caps it at the kernel's bound
        assignment = re.findall(rf"const int {threads} = ([^;]+);", before)
        assert assignment, (kernel, threads)
        assert re.fullmatch(rf"(block_threads|threads_for)\(.*,\s*{bound}\)", assignment[-1].strip()), \
            (kernel, assignment[-1])
    # ... and the two functions that compute blocks never exceed the bound they are given
    block_threads = re.search(r"int block_threads\(int64_t want, int bound\) \{(.*?)\n\}", source, re.S).group(1)
    assert "std::min<int64_t>(bound," in block_threads
    assert re.search(r"int threads_for\(int64_t packs, int bound\) \{ return block_threads\([^;]*, bound\); \}",
                     source)


def test_the_register_kernel_covers_its_row_within_the_bound():
    # rms_norm_fwd_regs_kernel reads PACKS packs per thread and does not loop: the host may take it only where
    # threads x PACKS covers the row, with threads within the bound, i.e. packs <= kFwdPacks x kMaxThreads.
    source = _source()
    assert "if (wide && packs <= static_cast<int64_t>(kFwdPacks) * kMaxThreads) {" in source
    assert "const int threads = block_threads(ceil_div(packs, kFwdPacks), kMaxThreads);" in source


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_registers_fit_the_largest_block_on_this_gpu():
    major, minor = torch.cuda.get_device_capability()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "cuda_resource_usage.py"), f"{major}{minor}"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 whose largest block does not fit" in done.stdout
