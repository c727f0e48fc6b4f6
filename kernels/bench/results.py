"""Benchmark results: where they live, how they are saved and loaded, and what they say.

A results dict is what ``kernels.bench.sweep.run_benchmark`` returns: settings, the measured
ceilings and one row per implementation × shape × pass. This module holds the paths (``ASSETS``,
``RESULTS``, the ceilings file), the layout of the results folder (``results_file``:
``<group>/<name>.json``, one folder per chapter or family), the finding of a run by its settings
(``find_run``, ``runs``), the JSON files, the device slug in their names, and the reading of a
results dict: speed-ups, targets, crossovers, tokens that fit, the summary and the table. It
measures nothing, so the plots and the chapters can read results without importing the benchmark
itself.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from kernels import runtime

ASSETS = Path(__file__).resolve().parents[2] / "assets"
RESULTS = ASSETS / "results"
CEILINGS_FILE = RESULTS / "ceilings.json"

KERNELS = ("rmsnorm", "cross_entropy", "swiglu", "rope")
SCHEMA_VERSION = 1
MIB = 2**20
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def check_kernel(kernel: str) -> None:
    """Refuse a kernel name the sweeps do not know.

    Args:
        kernel: the name.

    Raises:
        ValueError: when ``kernel`` is not one of ``KERNELS``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def first_line(exc: BaseException, width: int = 200) -> str:
    """The first line of an exception's message, cut to ``width`` characters: what a results row notes.

    Args:
        exc: the exception.
        width: the most characters kept.

    Returns:
        the line (empty for an empty message).
    """
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:width]


# --------------------------------------------------------------------------------------------------
# Files: the ceilings, the results
# --------------------------------------------------------------------------------------------------


def save_ceilings(ceilings: dict, path: Path = CEILINGS_FILE) -> Path:
    """Write the ceilings measured by ``kernels.bench.timing.measure_ceilings`` as JSON and return
    the path.

    Chapter 00 saves them.

    Args:
        ceilings: the dict of ``measure_ceilings``.
        path: the file (its folder is created).

    Returns:
        the path.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ceilings, indent=2) + "\n")
    return path


def load_ceilings(path: Path = CEILINGS_FILE) -> dict | None:
    """The ceilings stored by notebook 00 (or ``None`` if it has not run on a GPU yet).

    Args:
        path: the file.

    Returns:
        the ceilings, or None.
    """
    return json.loads(path.read_text()) if path.exists() else None


def device_slug() -> str:
    """A file-name-safe name of this device: ``nvidia-h200``, or ``cpu-interpreter``.

    Returns:
        the slug.
    """
    if runtime.MODE != "gpu":
        return "cpu-interpreter"
    return re.sub(r"[^a-z0-9]+", "-", runtime.device_name().lower()).strip("-")


def results_file(group: str, name: str, directory: Path = RESULTS, suffix: str = ".json") -> Path:
    """``<directory>/<group>/<name><suffix>``: where every writer puts a run (``directory`` is the
    results root).

    One folder per chapter or family (``rmsnorm``, ``finetune``, ``fsdp``, …) and a short name (a
    device slug, a preset, or a name given on the command line). What a run was set up with is
    inside the JSON, not in the name, so a new run with other flags under the same name replaces the
    file instead of adding a sibling.

    Args:
        group: the folder (a file name).
        name: the file's name without suffix (a file name).
        directory: the results root.
        suffix: the file's suffix.

    Returns:
        the path (nothing is created).

    Raises:
        ValueError: when ``group`` or ``name`` is empty or holds a folder.
    """
    return _group_dir(group, directory) / f"{_file_name('name', name)}{suffix}"


def _file_name(label: str, value: str) -> str:
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value:
        raise ValueError(f"{label} must be a file name without a folder, got {value!r}")
    return value


def _group_dir(group: str, directory: Path) -> Path:
    return Path(directory) / _file_name("group", group)


def save_results(results: dict, directory: Path = RESULTS) -> Path:
    """Write ``results`` as ``<directory>/<kernel>/<device slug>.json`` and return the path.

    Args:
        results: a sweep's results dict (its ``kernel`` and ``device_slug``).
        directory: the results root.

    Returns:
        the path.
    """
    path = results_file(results["kernel"], results["device_slug"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def load_results(kernel: str, directory: Path = RESULTS, include_interpreter: bool = False) -> dict | None:
    """The newest results JSON of ``kernel`` in ``directory/<kernel>/`` (GPU runs only unless
    asked), or None.

    Chapters 04, 07 and 11 read their sweeps with it.

    Args:
        kernel: one of ``KERNELS``.
        directory: the results root.
        include_interpreter: count interpreter runs too.

    Returns:
        the newest results dict by date, or None.

    Raises:
        ValueError: when ``kernel`` is unknown.
    """
    check_kernel(kernel)
    found = []
    for path in sorted((Path(directory) / kernel).glob("*.json")):
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if results.get("kernel") != kernel or (results.get("mode") != "gpu" and not include_interpreter):
            continue
        found.append(results)
    return max(found, key=lambda r: r.get("date", "")) if found else None


# --------------------------------------------------------------------------------------------------
# Finding a run by its settings
# --------------------------------------------------------------------------------------------------

# Settings the fine-tuning command line began to record after some committed runs were written, with
# the value those runs used (they had no such flag yet). ``patched_adamw`` follows ``adamw``.
FINETUNE_DEFAULTS = {"compile": None, "gradient_checkpointing": False, "padding_mask": True,
                     "adamw": "foreach"}


def run_settings(run: dict, group: str | None = None) -> dict:
    """What ``run`` was set up with: its ``settings`` dict over its top-level values that are
    neither lists nor dicts.

    Benchmarks keep their device, mode, kernel or preset at the top level (and some, such as the
    AdamW, overhead, linear cross-entropy and peak-memory runs, have no ``settings`` at all), so
    those count as settings too. In the ``finetune`` group a setting of ``FINETUNE_DEFAULTS`` that a
    run does not record takes the value it had then.

    Args:
        run: a results file's dict.
        group: its folder (``"finetune"`` fills in the defaults).

    Returns:
        the settings.
    """
    settings = {k: v for k, v in run.items() if not isinstance(v, (list, dict))}
    if isinstance(run.get("settings"), dict):
        settings.update(run["settings"])
    if group == "finetune":
        settings = {**FINETUNE_DEFAULTS, **settings}
        settings.setdefault("patched_adamw", settings["adamw"])
    return settings


def runs(group: str, directory: Path = RESULTS) -> dict[str, dict]:
    """Every run of ``group``: ``{file name: the parsed JSON}`` of ``directory/<group>/*.json``,
    sorted by name.

    Args:
        group: the folder.
        directory: the results root.

    Returns:
        file name -> its dict.
    """
    return {path.name: json.loads(path.read_text()) for path in sorted(_group_dir(group,
                                                                                  directory).glob("*.json"))}


def find_run(group: str, directory: Path = RESULTS, **settings) -> dict:
    """The one run of ``directory/<group>/`` whose settings (``run_settings``) hold every given key
    with an equal value.

    Values are compared with ``==``, so a nested dict such as ``patch_options`` must equal the
    stored one exactly (``patch_options={}``, patch_llama's default selection, matches only runs
    that used it). Raises ``LookupError``, listing the settings of the runs that are there, when
    none matches, and ``ValueError``, naming the files, when more than one does (give another
    setting to tell them apart).

    Chapters 09 to 12 read their runs with it.

    Args:
        group: the folder.
        directory: the results root.
        **settings: the settings the run must have.

    Returns:
        the run's dict.

    Raises:
        LookupError: when no run matches.
        ValueError: when more than one run matches.
    """
    found = runs(group, directory)
    missing = object()
    matches = []
    for name, run in found.items():
        have = run_settings(run, group)
        if all(have.get(key, missing) == value for key, value in settings.items()):
            matches.append(name)
    folder = _group_dir(group, directory)
    if len(matches) > 1:
        raise ValueError(f"{len(matches)} runs in {folder} match {settings}: {', '.join(matches)}")
    if not matches:
        listing = "\n".join(f"  {name}: {run_settings(run, group)}" for name,
                            run in found.items()) or "  (none)"
        raise LookupError(f"no run in {folder} has the settings {settings}; the runs there:\n{listing}")
    return found[matches[0]]


# --------------------------------------------------------------------------------------------------
# Reading results: speed-ups, targets, the table


BASES = ("device", "eager")


def _time(row: dict, basis: str) -> float | None:
    if basis not in BASES:
        raise ValueError(f"basis must be one of {BASES}, got {basis!r}")
    return row.get(f"{basis}_ms") if row.get("status") == "ok" else None


def _groups(results: dict) -> dict[tuple[int, int, str], list[dict]]:
    groups: dict[tuple[int, int, str], list[dict]] = {}
    for row in results["rows"]:
        groups.setdefault((row["tokens"], row["width"], row["pass"]), []).append(row)
    return groups


def speedups(results: dict, basis: str = "device") -> list[dict]:
    """For every shape and pass: ours' time, every peer's, speed-up = peer time / ours (above 1:
    ours is faster).

    Each entry: tokens, width, pass, basis, ours_ms, peers {key: ms}, speedup {key: ×}, fastest_peer
    (key or None), fastest_peer_ms, vs_fastest (fastest peer's time / ours). Times that are missing
    (skipped, failed, not capturable) are left out; an entry without ours has no speed-ups.

    Args:
        results: a sweep's results dict.
        basis: ``"device"`` or ``"eager"``.

    Returns:
        one entry per (tokens, width, pass).
    """
    out = []
    for (tokens, width, pass_), rows in _groups(results).items():
        ours = next((r for r in rows if r["role"] == "ours"), None)
        ours_ms = _time(ours, basis) if ours else None
        peers = {r["impl"]: _time(r, basis) for r in rows if r["role"] == "peer" and _time(r,
                                                                                           basis) is not None}
        fastest = min(peers, key=peers.get) if peers else None
        entry = {
            "tokens": tokens, "width": width, "pass": pass_, "basis": basis, "ours_ms": ours_ms,
            "peers": peers,
            "speedup": {k: v / ours_ms for k, v in peers.items()} if ours_ms else {},
            "fastest_peer": fastest, "fastest_peer_ms": peers.get(fastest),
            "vs_fastest": peers[fastest] / ours_ms if (fastest and ours_ms) else None,
        }
        out.append(entry)
    return out


def targets(results: dict, min_speedup: float = 1.0, bases=BASES) -> list[dict]:
    """Is ours at least ``min_speedup`` × as fast as the fastest peer? One entry per shape, pass and
    time basis.

    Each entry: shape, pass, basis, ours_ms, fastest_peer (its label), fastest_peer_ms, speedup, met
    (True/False, or None when there is nothing to compare), and for the device basis ours' fraction
    of the copy bandwidth and of a copy of the same bytes (``frac_same_bytes_copy``: the copy's time
    over ours, 1 as fast as that copy).

    Args:
        results: a sweep's results dict.
        min_speedup: the speed-up over the fastest peer that meets the target.
        bases: the time bases to read.

    Returns:
        one entry per shape, pass and basis.
    """
    labels = {k: v["label"] for k, v in results.get("implementations", {}).items()}
    ours_rows = {(r["tokens"], r["width"], r["pass"]): r for r in results["rows"] if r["role"] == "ours"}
    out = []
    for basis in bases:
        for e in speedups(results, basis):
            ours = ours_rows.get((e["tokens"], e["width"], e["pass"]))
            out.append({
                "shape": f"{e['tokens']}×{e['width']}", "tokens": e["tokens"], "width": e["width"],
                "pass": e["pass"], "basis": basis, "ours_ms": e["ours_ms"],
                "fastest_peer": labels.get(e["fastest_peer"], e["fastest_peer"]),
                "fastest_peer_ms": e["fastest_peer_ms"], "speedup": e["vs_fastest"],
                "met": None if e["vs_fastest"] is None else e["vs_fastest"] >= min_speedup,
                "frac_copy": ours.get("frac_copy") if (ours and basis == "device") else None,
                "frac_same_bytes_copy": ours.get("frac_same_bytes_copy") if (ours and basis == "device") else None,
            })
    return out


def crossovers(results: dict, basis: str = "device", pass_: str = "fwd+bwd") -> dict[str, int | None]:
    """Per peer: the smallest token count of the token sweep from which ours is faster at every larger size.

    None means ours is not faster at the largest size measured. Only the token sweep (the fixed
    width) is read.

    Chapter 07 reads them.

    Args:
        results: a sweep's results dict.
        basis: ``"device"`` or ``"eager"``.
        pass_: the pass.

    Returns:
        peer key -> token count, or None.
    """
    width = results["settings"]["width"]
    entries = sorted((e for e in speedups(results, basis) if e["pass"] == pass_ and e["width"] == width),
                     key=lambda e: e["tokens"])
    peers = sorted({k for e in entries for k in e["speedup"]})
    out = {}
    for peer in peers:
        points = [(e["tokens"], e["speedup"][peer]) for e in entries if peer in e["speedup"]]
        start = None
        for tokens, ratio in reversed(points):
            if ratio < 1.0:
                break
            start = tokens
        out[peer] = start
    return out


def tokens_that_fit(results: dict, budget_bytes: float, pass_: str = "fwd+bwd") -> dict[str, dict]:
    """How many tokens' worth of this kernel fit in ``budget_bytes``, per implementation, from
    measured peaks.

    A token costs its input row (a row of logits, [V] in the logits' dtype: it exists whatever the
    loss) plus the extra peak memory per token measured at the largest token count. Implementations
    without a measured peak (interpreter runs, failed rows) are left out.

    Chapter 07 uses it.

    Args:
        results: a sweep's results dict.
        budget_bytes: the memory to fill.
        pass_: the pass.

    Returns:
        implementation key -> its label, bytes per token, where they were measured, and the tokens.
    """
    best: dict[str, dict] = {}
    for row in results["rows"]:
        if row["pass"] != pass_ or row["status"] != "ok" or row["peak_extra_mib"] is None:
            continue
        if row["impl"] not in best or row["tokens"] > best[row["impl"]]["tokens"]:
            best[row["impl"]] = row
    out = {}
    for impl, row in best.items():
        input_per_token = row["width"] * DTYPES[row["dtype"]].itemsize
        extra_per_token = max(row["peak_extra_mib"], 0.0) * MIB / row["tokens"]
        per_token = input_per_token + extra_per_token
        out[impl] = {"label": row["label"], "bytes_per_token": per_token,
                     "extra_bytes_per_token": extra_per_token,
                     "measured_at_tokens": row["tokens"], "tokens": int(budget_bytes // per_token)}
    return out


def summarize(results: dict, min_speedup: float = 1.0) -> str:
    """A few lines: where ours beats the fastest peer, by how much, and how close it gets to the
    copy ceiling.

    Chapters 04 and 07 print it.

    Args:
        results: a sweep's results dict.
        min_speedup: the speed-up over the fastest peer that meets the target.

    Returns:
        the lines, joined by newlines.
    """
    lines = [f"{results['kernel']} on {results['device']} ({results['mode']}), {results['date']}"]
    if results["mode"] != "gpu":
        lines.append("  interpreter run: wall-clock times of the CPU say nothing about GPU speed; no comparison drawn")
    for basis in BASES if results["mode"] == "gpu" else ():
        for pass_ in results["settings"]["passes"]:
            entries = [t for t in targets(results, min_speedup, (basis,))
                       if t["pass"] == pass_ and t["met"] is not None]
            if not entries:
                continue
            met = sum(t["met"] for t in entries)
            ratios = [t["speedup"] for t in entries]
            geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            biggest = max(entries, key=lambda t: t["tokens"] * t["width"])
            line = (f"  {pass_:>7}, {basis} time: ours ≥ {min_speedup:g}× the fastest peer at {met} of {len(entries)} "
                    f"shapes; geometric mean {geo:.2f}×; at {biggest['shape']}: {biggest['speedup']:.2f}× vs "
                    f"{biggest['fastest_peer']}")
            if biggest.get("frac_copy"):
                line += f", {biggest['frac_copy']:.0%} of copy bandwidth"
            smallest = min(entries, key=lambda t: t["tokens"] * t["width"])
            if smallest.get("frac_same_bytes_copy") and smallest is not biggest:
                line += (f"; at {smallest['shape']}, {smallest['frac_same_bytes_copy']:.0%} of a copy of the same "
                         "bytes")
            lines.append(line)
    problems = [r for r in results["rows"] if r["status"] in ("check failed", "error")]
    for r in problems:
        lines.append(f"  {r['status'].upper()}: {r['label']} {r['shape']} {r['pass']}: {r['note']}")
    return "\n".join(lines)


def _fmt(value, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def format_table(results: dict) -> str:
    """The final table: one line per implementation × shape × pass, with ours' speed-up over each row.

    Chapters 04, 07 and 11 print it.

    Args:
        results: a sweep's results dict.

    Returns:
        the table, lines joined by newlines.
    """
    dev = {(e["tokens"], e["width"], e["pass"]): e["ours_ms"] for e in speedups(results, "device")}
    eag = {(e["tokens"], e["width"], e["pass"]): e["ours_ms"] for e in speedups(results, "eager")}
    eager_head = "eager ms" if results["mode"] == "gpu" else "wall ms*"
    head = (f"{'implementation':<44} {'shape':>12} {'pass':>7} {eager_head:>9} {'device ms':>9} {'GB/s':>7} "
            f"{'% copy':>6} {'% same':>6} {'ours× dev':>9} {'ours× eag':>9} {'peak MiB':>9}  status")
    lines = [head, "-" * len(head)]
    for row in results["rows"]:
        key = (row["tokens"], row["width"], row["pass"])
        ours_dev, ours_eag = dev.get(key), eag.get(key)
        x_dev = row["device_ms"] / ours_dev if (row["device_ms"] and ours_dev) else None
        x_eag = row["eager_ms"] / ours_eag if (row["eager_ms"] and ours_eag) else None
        status = row["status"] if row["status"] != "ok" else (
            "ok" if row["device_note"] is None or results["mode"] != "gpu" else "no graph")
        lines.append(
            f"{row['label'][:44]:<44} {row['shape']:>12} {row['pass']:>7} {_fmt(row['eager_ms'], '9.3f'):>9} "
            f"{_fmt(row['device_ms'], '9.3f'):>9} {_fmt(row['gbps'], '7.0f'):>7} "
            f"{_fmt(row['frac_copy'] and 100 * row['frac_copy'], '6.1f'):>6} "
            f"{_fmt(row.get('frac_same_bytes_copy') and 100 * row['frac_same_bytes_copy'], '6.1f'):>6} "
            f"{_fmt(x_dev, '9.3g'):>9} "
            f"{_fmt(x_eag, '9.3g'):>9} {_fmt(row['peak_extra_mib'], '9.1f'):>9}  {status}"
        )
    if results["mode"] != "gpu":
        lines.append("* wall-clock of Triton's CPU interpreter: meaningless as GPU time; no device times without a GPU")
    lines.append("ours× = this row's time / ours' time at the same shape and pass (above 1: ours is faster)")
    lines.append("% copy: of the copy bandwidth measured on gigabytes; % same: a copy of this row's bytes, timed the "
                 "same way, over this row's device time (100: as fast as that copy)")
    return "\n".join(lines)
