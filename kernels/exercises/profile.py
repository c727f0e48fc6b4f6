"""Check for chapter 01's exercise: from a step's profile, predict what fusing one operator family can gain.

The reader writes ``amdahl_speedup(share, factor)``, Amdahl's law for a part of the step that takes
``share`` of its time and becomes ``factor`` times faster, and fills a prediction from the family
table the chapter printed:

    prediction = {"family": "rmsnorm", "share": 0.125, "factor": 9}

``check_amdahl`` runs the function on a grid of shares and factors (and on ``factor = math.inf``,
the family costing nothing), recognises the usual wrong formulas, then checks the prediction against
the profile: a family a fused kernel can shrink, and its share read from the right row and column.
The function runs with the package's Amdahl's law (``step_speedup``, ``amdahl``) out of reach
(``reach.FORBIDDEN["amdahl_speedup"]``): calling it is refused by name. Every diagnosis is worded in
``HINTS``. It never raises because the reader's code is wrong or unfinished: it prints a verdict and
returns a :class:`Report`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kernels.training.profiling import FAMILIES, FAMILY_TITLES

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report, last_line, verdict
from .sentences import sentence_lookup

# The grid the function is tried on: shares of a step's time and how many times faster that part becomes.
SHARES = (0.05, 0.25, 0.5, 0.9)
FACTORS = (2.0, 4.0, 10.0)
# A share read from the table is printed to a tenth of a percent: this close counts as the same number.
SHARE_TOL = 0.0006
# Families whose operators are memory-bound chains a fused kernel of one's own can shorten; the rest
# already run as tuned vendor kernels (matmul, attention) or hold almost nothing (other).
FUSABLE = ("rmsnorm", "cross_entropy", "elementwise", "optimizer")

HINTS = {
    "raised": "your function raised {error} for share={share:g}, factor={factor:g}",
    "not_a_number": ("your function returned {type} for share={share:g}, factor={factor:g}, "
                     "expected a number"),
    "placeholder": ("your function returns 1 whatever the share and the factor: is it still the "
                    "placeholder? (a step whose part gets faster gets faster too)"),
    "whole_step": ("your function returns the factor itself, as if the whole step ran factor times "
                   "faster: only the family's share speeds up; the rest of the step, 1 − share, "
                   "takes as long as before"),
    "limit_only": ("your function ignores the factor and returns 1 / (1 − share): that is the "
                   "limit for a family that costs nothing (factor → ∞). With a finite factor the "
                   "family still takes share / factor"),
    "time_not_speedup": ("your function returns the new time of the step as a fraction of the old, "
                         "(1 − share) + share / factor; the speed-up is the old time over the new "
                         "one, the reciprocal"),
    "weighted_speeds": ("you averaged the speeds, (1 − share) · 1 + share · factor: speeds do not "
                        "add, times do. The new time is (1 − share) + share / factor, and the "
                        "speed-up is 1 over that"),
    "multiplied_time": ("you multiplied the family's time by the factor, 1 / ((1 − share) + share "
                        "· factor): a part that runs factor times faster takes share / factor of "
                        "the old time"),
    "sped_up_rest": ("you made the rest of the step faster instead of the family: the family's "
                     "share shrinks to share / factor, the other 1 − share stays"),
    "family_alone": ("you divided only the family's time, factor / share: the step's new time also "
                     "holds the rest, 1 − share, which does not get faster"),
    "subtracted_new_time": ("you subtracted the family's new time, 1 / (1 − share / factor): what "
                            "disappears is the time saved, share − share / factor, so the new time "
                            "is (1 − share) + share / factor"),
    "limit": ("your formula is right for finite factors but gives {got} for factor = math.inf, the "
              "family costing nothing, where the answer is 1 / (1 − share) = {expected:.4g}: write "
              "it as 1 / ((1 − share) + share / factor), in which share / factor simply becomes 0"),
    "unrecognised": ("for share={share:g}, factor={factor:g} your function returns {got:.6g}, but "
                     "Amdahl's law gives {expected:.6g}. Time the step as two parts: the one that "
                     "stays, and the one that shrinks"),
    # The prediction.
    "prediction_type": "prediction must be a dict with the keys 'family', 'share' and 'factor', got {got}",
    "no_family": ("not done yet: name, in prediction['family'], the family a fused kernel of your "
                  "own can shrink (one of {families})"),
    "unknown_family": "{family!r} is not a family of the table; the families are {families}",
    "vendor_family": ("{title} already runs as tuned vendor kernels (cuBLAS, fused attention) that "
                      "are bound by arithmetic, not by memory traffic: a fused kernel of your own "
                      "has nothing to remove there. Pick a family of many small memory-bound "
                      "operators"),
    "other_family": "{title} is views, allocation and overhead, almost no time: there is nothing to fuse",
    "no_share": ("not done yet: copy, into prediction['share'], the share of the {title} row of "
                 "the family table printed above"),
    "share_not_number": "prediction['share'] must be a number, got {got!r}",
    "percent": ("prediction['share'] = {share:g} is a percentage: Amdahl's law takes a fraction of "
                "the time, {fraction:.4g}"),
    "not_a_fraction": ("prediction['share'] = {share:g} is not a fraction of the step's time "
                       "(between 0 and 1)"),
    "other_row": ("prediction['share'] = {share:g} is the share of the {other} row; the prediction "
                  "is about {title}: read the share column of its own row"),
    "by_names": ("prediction['share'] = {share:g} is {title}'s share by names alone, the profile "
                 "without regions, which leaves most of its casts and multiplies in 'elementwise': "
                 "read the table sorted with regions and autograd's sequence numbers"),
    "operator_row": ("prediction['share'] = {share:g} is one operator's row of the operator table "
                     "({op}); a family is the sum of all its operators: read the family table"),
    "milliseconds": ("prediction['share'] = {share:g} is {title}'s time in milliseconds, not its "
                     "share: read the share column"),
    "wrong_share": ("prediction['share'] = {share:g} is not the share of the {title} row of the "
                    "family table: read its share column (and write it as a fraction: 12.5% is "
                    "0.125)"),
    "factor": ("prediction['factor'] must be a number above 1 (how many times faster the fused "
               "family runs), got {got!r}"),
    "passed": ("amdahl_speedup is right on {points} shares and factors, and for a family that "
               "costs nothing. Your prediction: {title} is {share:.1%} of this step's {kind}; made "
               "{factor:g}× faster, the step would run {speedup:.3f}× faster; even at no cost it "
               "could not beat {limit:.3f}×."),
    "passed_function": ("amdahl_speedup is right on {points} shares and factors, and for a family "
                        "that costs nothing."),
}


hint = sentence_lookup(HINTS)


def amdahl_reference(share: float, factor: float) -> float:
    """Amdahl's law: the step runs 1 / ((1 − share) + share / factor) times faster.

    The formula the check compares the reader's ``amdahl_speedup`` with (out of the reader's reach
    while it runs). Chapter: ``notebooks/01_profile_baseline.ipynb``.

    Args:
        share: the fraction of the step's time the sped-up part takes, in [0, 1).
        factor: how many times faster that part becomes; ``math.inf`` for a part that costs nothing.

    Returns:
        How many times faster the whole step runs.
    """
    return 1.0 / ((1.0 - share) + share / factor)


# The usual wrong formulas, each named by its diagnosis.
_SUSPECTS: dict[str, Callable[[float, float], float]] = {
    "placeholder": lambda s, f: 1.0,
    "whole_step": lambda s, f: f,
    "limit_only": lambda s, f: 1.0 / (1.0 - s),
    "time_not_speedup": lambda s, f: (1.0 - s) + s / f,
    "weighted_speeds": lambda s, f: (1.0 - s) + s * f,
    "multiplied_time": lambda s, f: 1.0 / ((1.0 - s) + s * f),
    "sped_up_rest": lambda s, f: 1.0 / ((1.0 - s) / f + s),
    "family_alone": lambda s, f: f / s,
    "subtracted_new_time": lambda s, f: 1.0 / (1.0 - s / f),
}


def check_amdahl(fn: Callable, prediction: dict | None = None, profile=None, by_names=None,
                 verbose: bool = True) -> Report:
    """Check the reader's Amdahl's law and, given the chapter's profile, the reader's prediction.

    Runs ``fn`` on a grid of shares and factors and on ``factor = math.inf``, with the package's
    Amdahl's law out of reach, and names the usual wrong formulas; then checks that the prediction
    names a family a fused kernel can shrink, with its share read from the right row and column of
    the family table. Chapter: ``notebooks/01_profile_baseline.ipynb``.

    Args:
        fn: the reader's ``amdahl_speedup(share, factor) -> speed-up``.
        prediction: ``{"family": ..., "share": ..., "factor": ...}``; None checks ``fn`` alone.
        profile: the chapter's ``StepProfile``, the table the share is read from; None checks ``fn``
            alone.
        by_names: the profile taken without regions, if the chapter made one: a share read from
            it is recognised and named.
        verbose: print the verdict (False: only return it).

    Returns:
        The ``Report``: ``passed``, and a message that names the first mistake, or, on a pass, the
        speed-up the prediction gives and its limit at no cost. It never raises because ``fn`` or
        the prediction is wrong.
    """
    try:
        problem = _check_function(fn)
    except _Finished as called:
        return verdict(False, str(called), verbose)
    if problem is not None:
        return verdict(False, problem, verbose)
    points = len(SHARES) * len(FACTORS)
    if prediction is None or profile is None:
        return verdict(True, hint("passed_function", points=points), verbose)
    problem, family, share, factor = _check_prediction(prediction, profile, by_names)
    if problem is not None:
        return verdict(False, problem, verbose)
    title = _title(family)
    return verdict(True, hint("passed", points=points, title=title, share=share, kind=profile.time_kind,
                              factor=factor, speedup=amdahl_reference(share, factor),
                              limit=1.0 / (1.0 - share)),
                   verbose)


class _Finished(Exception):
    """The reader's function called a finished answer (the package's Amdahl's law): the message is
    the verdict."""


def _value(fn, share, factor):
    """fn(share, factor) as a float, or (None, what went wrong); raises ``_Finished`` when fn called
    a finished answer."""
    try:
        out = call_learner("amdahl_speedup", fn, share, factor)
    except FinishedCodeCalled as called:
        raise _Finished(str(called)) from None
    except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
        return None, hint("raised", error=f"{type(error).__name__}: {last_line(error)}",
                          share=share, factor=factor)
    try:
        return float(out), None
    except (TypeError, ValueError):
        return None, hint("not_a_number", type=type(out).__name__, share=share, factor=factor)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _check_function(fn) -> str | None:
    got = {}
    for share in SHARES:
        for factor in FACTORS:
            value, problem = _value(fn, share, factor)
            if problem is not None:
                return problem
            got[share, factor] = value
    if all(_close(v, amdahl_reference(s, f)) for (s, f), v in got.items()):
        for share in SHARES:  # the limit: the family costs nothing
            value, problem = _value(fn, share, math.inf)
            expected = 1.0 / (1.0 - share)
            if problem is not None or not _close(value, expected):
                shown = problem or f"{value:g}"
                return hint("limit", got=shown, expected=expected)
        return None
    for key, wrong in _SUSPECTS.items():
        if all(_close(v, wrong(s, f)) for (s, f), v in got.items()):
            return hint(key)
    (share, factor), value = next(((k, v) for k, v in got.items() if not _close(v, amdahl_reference(*k))))
    return hint("unrecognised", share=share, factor=factor, got=value,
                expected=amdahl_reference(share, factor))


def _title(family: str) -> str:
    return FAMILY_TITLES.get(family, family).split(" (")[0]


def _check_prediction(prediction, profile, by_names):
    """(problem, family, share, factor): problem is None when the prediction is sound."""
    families = ", ".join(repr(f) for f in FAMILIES)
    if not isinstance(prediction, dict) or not {"family", "share", "factor"} <= set(prediction):
        return hint("prediction_type", got=prediction), None, None, None
    family, share, factor = prediction["family"], prediction["share"], prediction["factor"]
    if not family:
        return hint("no_family", families=families), None, None, None
    if family not in FAMILIES:
        return hint("unknown_family", family=family, families=families), None, None, None
    title = _title(family)
    if family in ("matmul", "attention"):
        return hint("vendor_family", title=title), None, None, None
    if family not in FUSABLE:
        return hint("other_family", title=title), None, None, None
    if share is None:
        return hint("no_share", title=title), None, None, None
    if isinstance(share, bool) or not isinstance(share, (int, float)):
        return hint("share_not_number", got=share), None, None, None
    row = profile.families.get(family)
    right = row.share if row is not None else 0.0
    if not math.isclose(share, right, abs_tol=SHARE_TOL):
        return _wrong_share(share, family, title, right, profile, by_names), None, None, None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        return hint("factor", got=factor), None, None, None
    return None, family, float(share), float(factor)


def _wrong_share(share, family, title, right, profile, by_names) -> str:
    """Which number of the printed tables the share was read from, if any."""
    if 1 < share <= 100 and math.isclose(share / 100, right, abs_tol=SHARE_TOL):
        return hint("percent", share=share, fraction=share / 100)
    fraction = share / 100 if share > 1 else share
    for other, row in profile.families.items():
        if other != family and math.isclose(fraction, row.share, abs_tol=SHARE_TOL):
            return hint("other_row", share=share, other=_title(other), title=title)
    if by_names is not None and math.isclose(fraction, by_names.share(family), abs_tol=SHARE_TOL):
        return hint("by_names", share=share, title=title)
    for op in list(profile.top_ops) + list(profile.top_kernels):
        if math.isclose(fraction, op.share, abs_tol=SHARE_TOL):
            return hint("operator_row", share=share, op=f"{op.name}, {op.share:.1%}")
    row = profile.families.get(family)
    if row is not None and math.isclose(share, row.time_ms, rel_tol=1e-3, abs_tol=0.0006):
        return hint("milliseconds", share=share, title=title)
    if share > 1:
        return hint("not_a_fraction", share=share)
    return hint("wrong_share", share=share, title=title)
