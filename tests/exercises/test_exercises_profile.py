"""Chapter 01's exercise check: it passes Amdahl's law and a prediction read from the right row, and names each
planted mistake, in the formula and in the reading of the profile, without raising."""

import math
import re
import warnings

import diagnoses
import pytest

from kernels.exercises import solutions
from kernels.exercises.profile import HINTS, SHARES, amdahl_reference, check_amdahl
from kernels.exercises.solutions import load
from kernels.training.profiling import (
    PROFILER_NOTICE,
    REPOSITORY,
    TRACES,
    Row,
    StepProfile,
    display_path,
    quiet_profiler,
    step_speedup,
)

# A profile shaped like the chapter's: shares of GPU kernel time by family, and operator rows. No step is run.
FAMILY_SHARES = {"matmul": 0.394, "attention": 0.092, "rmsnorm": 0.087, "cross_entropy": 0.012,
                 "elementwise": 0.079, "optimizer": 0.336, "other": 0.0003}
TOTAL_MS = 300.0


def fake_profile() -> StepProfile:
    families = {f: Row(f, f, 10, s * TOTAL_MS, s) for f, s in FAMILY_SHARES.items()}
    ops = [Row("aten::mm", "matmul", 675, 118.4, 0.3944), Row("aten::mul", "rmsnorm", 650, 11.6, 0.039),
           Row("aten::copy_", "rmsnorm", 325, 6.0, 0.0201)]
    return StepProfile(device="test GPU", time_kind="GPU kernel time", step_ms=318.5, profiled_step_ms=330.0,
                       tokens=2048, families=families, phases={}, top_ops=ops, top_kernels=[], memory=None,
                       trace_path=None, total_ms=TOTAL_MS)


class FakeByNames:
    """The profile taken without regions: RMSNorm's casts and multiplies counted as elementwise."""

    def share(self, *families):
        return sum({"rmsnorm": 0.008, "cross_entropy": 0.007, "elementwise": 0.163}.get(f, 0.0) for f in families)


def says(key: str, message: str) -> bool:
    """Whether ``message`` holds the diagnosis ``HINTS[key]``."""
    return diagnoses.says(HINTS[key], message)


def right(share, factor):
    return 1 / ((1 - share) + share / factor)


PREDICTION = {"family": "rmsnorm", "share": 0.087, "factor": 9}


# ---------------------------------------------------------------------------------------------------------------------
# The formula
# ---------------------------------------------------------------------------------------------------------------------


def test_the_solution_passes_and_is_the_package_formula():
    fn = load("amdahl_speedup")
    assert "amdahl_speedup" in solutions.names()
    assert check_amdahl(fn, verbose=False).passed
    for share in SHARES:
        assert fn(share, 4.0) == pytest.approx(step_speedup(share, 4.0)) == pytest.approx(amdahl_reference(share, 4))
        assert fn(share, math.inf) == pytest.approx(step_speedup(share)) == pytest.approx(1 / (1 - share))


PLANTED_FORMULAS = {
    "placeholder": lambda s, f: 1.0,
    "whole_step": lambda s, f: f,
    "limit_only": lambda s, f: 1 / (1 - s),
    "time_not_speedup": lambda s, f: (1 - s) + s / f,
    "weighted_speeds": lambda s, f: 1 + s * (f - 1),
    "multiplied_time": lambda s, f: 1 / ((1 - s) + s * f),
    "sped_up_rest": lambda s, f: 1 / ((1 - s) / f + s),
    "family_alone": lambda s, f: f / s,
    "subtracted_new_time": lambda s, f: 1 / (1 - s / f),
    "limit": lambda s, f: f / (f * (1 - s) + s),  # right, but inf / inf is NaN when the family costs nothing
    "unrecognised": lambda s, f: 1.01 * right(s, f),
    "raised": lambda s, f: 1 / 0,
    "not_a_number": lambda s, f: "fast",
}


@pytest.mark.parametrize("key", list(PLANTED_FORMULAS))
def test_each_wrong_formula_is_named(key, capsys):
    report = check_amdahl(PLANTED_FORMULAS[key], PREDICTION, fake_profile())
    assert not report.passed and report.message.startswith("✗ ")
    assert says(key, report.message), report.message
    assert capsys.readouterr().out.strip() == report.message  # printed, not raised


def stub(share, factor):
    # The chapter's cell as it ships.
    return 1.0


def test_the_stub_as_shipped_is_named_the_placeholder():
    report = check_amdahl(stub, {"family": None, "share": None, "factor": 9}, fake_profile(), verbose=False)
    assert not report.passed and says("placeholder", report.message), report.message


def borrowed_step_speedup(share, factor):
    return step_speedup(share, factor)


def borrowed_by_module(share, factor):
    import kernels.training.profiling as profiling

    return profiling.step_speedup(share, factor)


def borrowed_reference(share, factor):
    from kernels.exercises import profile

    return profile.amdahl_reference(share, factor)


def borrowed_and_caught(share, factor):
    try:
        return step_speedup(share, factor)
    except Exception:  # noqa: BLE001  (a learner hiding the refusal: still refused)
        return 1.0 / ((1.0 - share) + share / factor)


@pytest.mark.parametrize("fn, name", [
    (step_speedup, "step_speedup"),  # the package's function handed to the check
    (borrowed_step_speedup, "step_speedup"),  # called by the name the chapter imported
    (borrowed_by_module, "step_speedup"),
    (borrowed_reference, "amdahl_reference"),
    (borrowed_and_caught, "step_speedup"),
])
def test_the_finished_law_is_refused_by_name(fn, name):
    report = check_amdahl(fn, PREDICTION, fake_profile(), verbose=False)
    assert not report.passed and name in report.message and "finished answer" in report.message, report.message
    assert step_speedup(0.5, 2) == pytest.approx(4 / 3)  # put back afterwards


def test_the_limit_diagnosis_says_what_the_answer_is():
    report = check_amdahl(PLANTED_FORMULAS["limit"], verbose=False)
    assert "gives nan for factor = math.inf" in report.message, report.message


# ---------------------------------------------------------------------------------------------------------------------
# The prediction, read from the printed tables
# ---------------------------------------------------------------------------------------------------------------------


def test_a_right_prediction_passes_and_prints_what_it_predicts(capsys):
    report = check_amdahl(load("amdahl_speedup"), PREDICTION, fake_profile(), FakeByNames())
    assert report.passed, report.message
    out = capsys.readouterr().out
    assert "RMSNorm is 8.7% of this step's GPU kernel time; made 9× faster" in out
    assert f"{right(0.087, 9):.3f}× faster" in out and f"{1 / (1 - 0.087):.3f}×" in out


@pytest.mark.parametrize("prediction, key", [
    (None, None),
    ({"family": None, "share": None, "factor": 9}, "no_family"),
    ({"family": "rmsnorm"}, "prediction_type"),
    ({"family": "layernorm", "share": 0.1, "factor": 9}, "unknown_family"),
    ({"family": "matmul", "share": 0.394, "factor": 9}, "vendor_family"),
    ({"family": "attention", "share": 0.092, "factor": 9}, "vendor_family"),
    ({"family": "other", "share": 0.0, "factor": 9}, "other_family"),
    ({"family": "rmsnorm", "share": None, "factor": 9}, "no_share"),
    ({"family": "rmsnorm", "share": "8.7%", "factor": 9}, "share_not_number"),
    ({"family": "rmsnorm", "share": 8.7, "factor": 9}, "percent"),
    ({"family": "rmsnorm", "share": 0.092, "factor": 9}, "other_row"),  # attention's row
    ({"family": "rmsnorm", "share": 0.008, "factor": 9}, "by_names"),
    ({"family": "rmsnorm", "share": 0.039, "factor": 9}, "operator_row"),  # aten::mul's row of the operator table
    ({"family": "rmsnorm", "share": 26.1, "factor": 9}, "milliseconds"),
    ({"family": "rmsnorm", "share": 140.0, "factor": 9}, "not_a_fraction"),
    ({"family": "rmsnorm", "share": 0.05, "factor": 9}, "wrong_share"),
    ({"family": "rmsnorm", "share": 0.087, "factor": 1}, "factor"),
    ({"family": "rmsnorm", "share": 0.087, "factor": None}, "factor"),
])
def test_each_misread_prediction_is_named(prediction, key):
    report = check_amdahl(load("amdahl_speedup"), prediction, fake_profile(), FakeByNames(), verbose=False)
    if key is None:  # no prediction: the formula alone is checked
        assert report.passed and says("passed_function", report.message), report.message
        return
    assert not report.passed, report.message
    assert says(key, report.message), (key, report.message)


def test_memory_bound_families_other_than_rmsnorm_are_accepted():
    for family in ("cross_entropy", "elementwise", "optimizer"):
        prediction = {"family": family, "share": FAMILY_SHARES[family], "factor": 3}
        assert check_amdahl(load("amdahl_speedup"), prediction, fake_profile(), verbose=False).passed


# ---------------------------------------------------------------------------------------------------------------------
# What the chapter's cells print around the profile
# ---------------------------------------------------------------------------------------------------------------------


def test_step_speedup_refuses_what_is_not_a_share():
    with pytest.raises(ValueError, match="share must be a fraction"):
        step_speedup(8.7)
    with pytest.raises(ValueError, match="factor must be positive"):
        step_speedup(0.1, 0)


def test_trace_paths_print_relative_to_the_repository(tmp_path):
    assert display_path(TRACES / "step.json") == "assets/traces/step.json"
    assert not display_path(TRACES / "step.json").startswith(str(REPOSITORY))
    assert display_path(tmp_path / "x.json") == str(tmp_path / "x.json")  # outside the repository: as given


def test_quiet_profiler_filters_only_the_cycle_notice():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_profiler():
            notice = "Warning: Profiler clears events at the end of each cycle. Only events ..."
            warnings.warn(notice, UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
    assert re.match(PROFILER_NOTICE, "Warning: Profiler clears events at the end of each cycle.")
