"""Shared test set-up: `gpu`-marked tests run only where CUDA is present; each test gets fresh random inputs that can
be replayed.

Every session draws a random seed (printed in pytest's header) unless ``--seed N`` or the environment variable
``KERNELS_TEST_SEED=N`` gives one. Each test derives its own seed from the session's and its node id, so a test
sees the same inputs whether it runs alone or in the whole suite; the ``gen`` fixture and the global torch, NumPy
and ``random`` generators are seeded with it. A failing test's report names both seeds and the command that
replays it.
"""

import importlib.util
import os
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings


def _require_our_kernels() -> None:
    """Stop the run, with the fix, when ``import kernels`` would give another distribution's package (Hugging Face's
    Kernel Hub is also named ``kernels``). The check is loaded by its path: imported by name, it would be theirs."""
    path = Path(__file__).resolve().parent.parent / "kernels" / "name_check.py"
    spec = importlib.util.spec_from_file_location("kernels_name_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    message = module.problem(path.parent)
    if message is not None:
        raise pytest.UsageError(message)


_require_our_kernels()

import kernels  # noqa: E402, F401  (sets the runtime mode before any kernel is defined)
from kernels import runtime  # noqa: E402

SEED_ENV = "KERNELS_TEST_SEED"
HYPOTHESIS_PROFILE_ENV = "KERNELS_HYPOTHESIS_PROFILE"

# hypothesis (tests/support/strategies.py): a few examples per test in the interpreter, where each kernel launch costs
# milliseconds and CI has a time budget; many more on a GPU. No deadline: the first call of a kernel compiles it.
_HYPOTHESIS_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("cpu", max_examples=12, deadline=None, suppress_health_check=_HYPOTHESIS_SLOW,
                          derandomize=False, print_blob=True)
settings.register_profile("gpu", max_examples=300, deadline=None, suppress_health_check=_HYPOTHESIS_SLOW,
                          print_blob=True)
_profile = os.environ.get(HYPOTHESIS_PROFILE_ENV, "").strip() or ("gpu" if runtime.MODE == "gpu" else "cpu")
if _profile not in ("cpu", "gpu"):
    raise pytest.UsageError(f"{HYPOTHESIS_PROFILE_ENV} must be cpu or gpu, got {_profile!r}")
settings.load_profile(_profile)
_SESSION_SEED = pytest.StashKey[int]()


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help=f"random seed of the session, to replay a run (default: ${SEED_ENV}, else a fresh one)")


def pytest_configure(config):
    seed = config.getoption("--seed")
    if seed is None and os.environ.get(SEED_ENV, "").strip():
        try:
            seed = int(os.environ[SEED_ENV])
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {os.environ[SEED_ENV]!r}") from None
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    config.stash[_SESSION_SEED] = seed


def pytest_report_header(config):
    seed = config.stash[_SESSION_SEED]
    return (f"random seed: {seed} (replay with `pytest --seed {seed}` or {SEED_ENV}={seed}); "
            f"hypothesis profile: {_profile} (${HYPOTHESIS_PROFILE_ENV})")


def seed_of_test(config, nodeid: str) -> int:
    """The seed of one test: the session's seed and the test's node id, so it does not depend on what else runs."""
    return (config.stash[_SESSION_SEED] + zlib.crc32(nodeid.encode())) % 2**32


def pytest_collection_modifyitems(config, items):
    if runtime.MODE == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this run uses the Triton interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        session = item.config.stash[_SESSION_SEED]
        report.sections.append((
            "random seed",
            f"session seed {session}, this test's seed {seed_of_test(item.config, item.nodeid)}; replay with\n"
            f"  pytest --seed {session} '{item.nodeid}'",
        ))
    return report


@pytest.fixture
def seed(request) -> int:
    """This test's seed (see the module docstring)."""
    return seed_of_test(request.config, request.node.nodeid)


@pytest.fixture(autouse=True)
def _seeded_global_generators(seed):
    # Code that draws from the global generators (torch.randn without a generator, model initialisation) replays too.
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture
def device():
    return runtime.device()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: each compiles from scratch, and leaves no compiled code,
    guards or recompilation counts to the next (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def gen(seed):
    """A CPU random generator seeded from this test's seed: fresh inputs on every run, the same ones on a replay."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        seed = config.stash[_SESSION_SEED]
        terminalreporter.write_line(f"random seed of this session: {seed} (replay with `pytest --seed {seed}`)")
