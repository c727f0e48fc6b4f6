"""The container (Dockerfile, scripts/, the README's `docker run`) read as text: `docker build` cannot run in CI, so
these check what a build would do: a current NGC base image, the image's pip constraints honoured, caches in the
mounted checkout, nothing tied to x86-64, and a `docker run` line with the flags the README explains."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
README = (ROOT / "README.md").read_text()
WORKSPACE = "/workspace/workbook"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each Dockerfile instruction, continuation lines joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def env() -> dict[str, str]:
    values = {}
    for name, args in instructions(DOCKERFILE):
        if name == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                values[key] = value
    return values


def run_steps() -> list[str]:
    return [args for name, args in instructions(DOCKERFILE) if name == "RUN"]


def test_the_base_image_is_a_26_release_or_later():
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M).group(1)
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", base)
    assert m, base
    assert (int(m.group(1)), int(m.group(2))) >= (26, 1)  # Triton's Blackwell support (NVIDIA's DGX playbooks)
    assert ("FROM", "${BASE_IMAGE}") in instructions(DOCKERFILE)
    assert f"pytorch:{m.group(1)}.{m.group(2)}-py3" in README  # the README names the tag the Dockerfile pins


def test_requirements_install_under_the_images_constraints():
    install = [step for step in run_steps() if "-r /tmp/requirements-container.txt" in step]
    assert len(install) == 1
    step = install[0]
    assert 'constraint="${PIP_CONSTRAINT:-/etc/pip/constraint.txt}"' in step
    assert 'test -s "$constraint"' in step  # a missing constraints file stops the build
    assert '--constraint "$constraint"' in step
    assert "PIP_CONSTRAINT" not in env()  # never switched off
    for escape in ("--force-reinstall", "--upgrade", " -U ", "--no-deps -r", "PIP_CONSTRAINT= ", "--ignore-installed"):
        assert escape not in step, escape
    # a package of the image changed by the install fails the build
    assert "pip freeze --all" in step and "comm -23 /tmp/before.txt /tmp/after.txt" in step and "exit 1" in step


def test_torch_and_triton_lines_are_left_out(tmp_path):
    pattern = re.search(r"grep -vE '([^']+)' requirements.txt", DOCKERFILE).group(1)
    lines = ["torch==2.13.0", "triton>=3.2", "torch", "triton ; sys_platform == 'linux'", "torchvision==0.20",
             "transformers>=4.56", "tritonclient", "numpy"]
    (tmp_path / "r.txt").write_text("\n".join(lines) + "\n")
    kept = subprocess.run(["grep", "-vE", pattern, str(tmp_path / "r.txt")], capture_output=True, text=True).stdout
    assert kept.split() == ["torchvision==0.20", "transformers>=4.56", "tritonclient", "numpy"]
    # the wheel check filters the same way
    assert pattern in (ROOT / "scripts" / "check-arm64-wheels.sh").read_text()


def test_nothing_the_requirements_ask_for_is_pinned_to_one_version_but_torch():
    pinned = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
              if "==" in line and not line.startswith(("#", "torch==", "triton=="))]
    assert pinned == []  # an exact pin would fight the image's constraints


def test_caches_live_in_the_mounted_checkout():
    values = env()
    for name in ("TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "HOME"):
        assert values[name].startswith(f"{WORKSPACE}/.cache/"), name
    assert values["HF_HOME"] == "/workspace/hf-cache" and "chmod 1777 /workspace/hf-cache" in DOCKERFILE
    assert values["TORCH_CUDA_ARCH_LIST"] == ""  # the CUDA extension builds for this GPU unless asked otherwise
    assert ".cache/" in (ROOT / ".gitignore").read_text().split()
    assert ".cache" in (ROOT / ".dockerignore").read_text().split()
    workdir = [args for name, args in instructions(DOCKERFILE) if name == "WORKDIR"]
    assert workdir == [WORKSPACE]


def test_no_step_is_tied_to_x86():
    code = "\n".join(args for _, args in instructions(DOCKERFILE))
    for x86 in ("x86_64", "amd64", "x64", "--platform", "linux/", "intel", "mkl"):
        assert x86 not in code.lower(), x86
    assert not re.search(r"\b(curl|wget)\b", code)  # no prebuilt binaries fetched: they would be for one CPU
    assert "apt-get" not in code  # nothing from the distribution either


def test_jupyter_binds_inside_and_the_readme_publishes_on_the_loopback():
    cmd = [args for name, args in instructions(DOCKERFILE) if name == "CMD"][-1]
    assert '"--ip=0.0.0.0"' in cmd and f'"--ServerApp.root_dir={WORKSPACE}"' in cmd


def test_readme_docker_run_has_every_flag_it_explains():
    section = README[README.index("## In the NVIDIA PyTorch container"):README.index("## Outside Jupyter")]
    run = re.search(r"docker run (.*?)\n```", section, re.S).group(1).replace("\\\n", " ")
    args = shlex.split(run.replace('"$(id -u):$(id -g)"', "UID:GID"))
    for flag in ("-it", "--rm", "--ipc=host"):
        assert flag in args, flag
    pairs = list(zip(args, args[1:]))
    for pair in [("--gpus", "all"), ("--ulimit", "memlock=-1"), ("--ulimit", "stack=67108864"),
                 ("-p", "127.0.0.1:8888:8888"), ("--user", "UID:GID")]:
        assert pair in pairs, pair
    assert any(a == "-v" and b.endswith(f":{WORKSPACE}") for a, b in pairs)
    assert any(a == "-v" and b.endswith(":/workspace/hf-cache") for a, b in pairs)
    assert args[-1] == "llm-kernel-workbook" and "IMAGE=\"${IMAGE:-llm-kernel-workbook}\"" in \
        (ROOT / "scripts" / "docker-build.sh").read_text()
    for word in ("root", "chown", "127.0.0.1", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "kernels.prebuild"):
        assert word in section, word


@pytest.mark.parametrize("script", ["docker-build.sh", "check-arm64-wheels.sh", "cuda_resource_usage.py"])
def test_scripts_are_executable_and_parse(script):
    path = ROOT / "scripts" / script
    assert os.access(path, os.X_OK), f"chmod +x scripts/{script}"
    check = ["bash", "-n", str(path)] if script.endswith(".sh") else ["python3", "-m", "py_compile", str(path)]
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if script.endswith(".sh"):
        assert "set -euo pipefail" in path.read_text()


def test_the_wheel_check_asks_for_arm64_wheels_only():
    text = (ROOT / "scripts" / "check-arm64-wheels.sh").read_text()
    assert "--only-binary=:all:" in text and "manylinux2014_aarch64" in text
    assert 'PYTHON_VERSION="${PYTHON_VERSION:-3.12}"' in text  # the image's Python
