"""Plots of benchmark results (the dicts ``kernels.bench.sweep.run_benchmark`` returns and
``load_results`` reads).

Every function takes a results dict, draws on ``ax`` (a new figure when None) and returns the axes,
so a notebook can arrange them and the command line can save them. Device times (CUDA-graph replays)
are what bandwidth and speed-ups are computed from; an interpreter run has none, and the plots say
so instead of drawing nonsense.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import FuncFormatter

from .results import BASES, speedups

# One colour per implementation key, the same in every plot of both kernels.
COLORS = {
    "ours": "#d62728", "ours-buffer": "#ff9896", "hf": "#7f7f7f", "compile": "#1f77b4", "native": "#2ca02c",
    "liger": "#9467bd", "fp32": "#7f7f7f", "bf16": "#2ca02c",
}
SWEEPS = ("tokens", "width")


def _new_axes(ax):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(7, 4.2))
    return ax


def _labels(results: dict) -> dict[str, str]:
    return {k: v["label"] for k, v in results["implementations"].items()}


def _width_name(results: dict) -> str:
    return results.get("width_name", "width")


def sweep_rows(results: dict, pass_: str = "fwd+bwd", sweep: str = "tokens") -> dict[str, list[dict]]:
    """Rows of one sweep and pass, by implementation key, sorted by the swept size.

    ``sweep="tokens"``: the token sweep at the fixed width; ``"width"``: the hidden-size (or
    vocabulary) sweep at its fixed token count.

    Args:
        results: a sweep's results dict.
        pass_: ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"``.
        sweep: ``"tokens"`` or ``"width"``.

    Returns:
        implementation key -> its rows.

    Raises:
        ValueError: when ``sweep`` is not one of ``SWEEPS``.
    """
    if sweep not in SWEEPS:
        raise ValueError(f"sweep must be one of {SWEEPS}, got {sweep!r}")
    s = results["settings"]
    if sweep == "tokens":
        keep = lambda r: r["width"] == s["width"] and r["tokens"] in s["tokens"]  # noqa: E731
    else:
        keep = lambda r: r["tokens"] == s["width_sweep_tokens"] and r["width"] in s["width_sweep"]  # noqa: E731
    out: dict[str, list[dict]] = {}
    for row in results["rows"]:
        if row["pass"] == pass_ and keep(row):
            out.setdefault(row["impl"], []).append(row)
    x = "tokens" if sweep == "tokens" else "width"
    return {k: sorted(v, key=lambda r: r[x]) for k, v in out.items()}


def _x(row: dict, sweep: str) -> int:
    return row["tokens"] if sweep == "tokens" else row["width"]


def _xlabel(results: dict, sweep: str) -> str:
    s = results["settings"]
    if sweep == "tokens":
        return f"tokens (rows), {_width_name(results)} {s['width']:,}"
    return f"{_width_name(results)} size, {s['width_sweep_tokens']:,} tokens"


def _title(results: dict, what: str) -> str:
    where = results["device"] if results["mode"] == "gpu" else "CPU interpreter (times meaningless)"
    return f"{results['kernel']}: {what}\n{where}"


def _log2_x(ax, values) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{v:,}" for v in ticks], rotation=45, ha="right")
        ax.minorticks_off()


def _nothing_to_show(ax, text: str):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    return ax


def _finish_line_plot(ax, results: dict, sweep: str, xs, ylabel: str, what: str, log_y: bool = True,
                      legend: int = 8):
    """Axes, labels, title, grid and legend shared by the line plots."""
    _log2_x(ax, xs)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(_xlabel(results, sweep))
    ax.set_ylabel(ylabel)
    ax.set_title(_title(results, what), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend)
    return ax


def plot_bandwidth(results: dict, pass_: str = "fwd+bwd", sweep: str = "tokens", ax=None,
                   floor_bytes: bool = False):
    """Achieved GB/s (minimal bytes / device time) per implementation, with the measured copy
    bandwidth as a line.

    ``floor_bytes=True`` counts the cross-entropy at its single-read floor (4 bytes per bf16 logit)
    instead of the two-read design (6): the line then reads as a fraction of the speed of light of
    any cross-entropy.

    Chapters 04 and 11 draw it.

    Args:
        results: a sweep's results dict.
        pass_: ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"``.
        sweep: ``"tokens"`` or ``"width"``.
        ax: a matplotlib axes to draw on (None: a new figure).
        floor_bytes: count the cross-entropy's bytes at its single-read floor.

    Returns:
        the axes (with a note instead of lines when the results have no device times).
    """
    ax = _new_axes(ax)
    key = "gbps_floor" if floor_bytes else "gbps"
    labels, xs = _labels(results), []
    for impl, rows in sweep_rows(results, pass_, sweep).items():
        pts = [(_x(r, sweep), r[key]) for r in rows if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color=COLORS.get(impl), label=labels.get(impl, impl))
            xs += [p[0] for p in pts]
    if not xs:
        return _nothing_to_show(ax,
                                "no device times in these results (an interpreter run): no bandwidth to plot")
    copy = (results.get("ceilings") or {}).get("copy_gbps")
    if copy:
        ax.axhline(copy, color="black", ls="--", lw=1, label=f"measured copy {copy:,.0f} GB/s")
    same = _same_bytes_copy_points(results, pass_, sweep, key)
    if same:
        ax.plot(*zip(*same), ":", color="black", lw=1, label="a copy of the same bytes")
    return _finish_line_plot(ax, results, sweep, xs, "GB/s (minimal bytes / device time)",
                             f"bandwidth, {pass_}",
                             log_y=False)


def _same_bytes_copy_points(results: dict, pass_: str, sweep: str, key: str) -> list[tuple[float, float]]:
    # The yardstick at each size: ours' minimal bytes over the device time of PyTorch's copy of them
    # (the row's copy_same_bytes_ms; absent from results written before the sweep timed it).
    n_bytes = "bytes_floor" if key == "gbps_floor" else "bytes"
    ours = next((rows for impl, rows in sweep_rows(results, pass_, sweep).items()
                 if results["implementations"].get(impl, {}).get("role") == "ours"), [])
    return [(_x(r, sweep), r[n_bytes] / (r["copy_same_bytes_ms"] * 1e-3) / 1e9) for r in ours
            if r.get("copy_same_bytes_ms")]


def plot_times(results: dict, pass_: str = "fwd+bwd", sweep: str = "tokens", basis: str = "device", ax=None):
    """Time per call vs size, per implementation, log-log. ``basis="both"``: device solid, eager dashed.

    Chapters 04, 07 and 11 draw it.

    Args:
        results: a sweep's results dict.
        pass_: ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"``.
        sweep: ``"tokens"`` or ``"width"``.
        basis: ``"device"``, ``"eager"`` or ``"both"`` (an interpreter run has eager times only).
        ax: a matplotlib axes to draw on (None: a new figure).

    Returns:
        the axes.
    """
    ax = _new_axes(ax)
    bases = BASES if basis == "both" else (basis,)
    if results["mode"] != "gpu":
        bases = ("eager",)  # the interpreter has wall-clock only
    labels, xs = _labels(results), []
    for impl, rows in sweep_rows(results, pass_, sweep).items():
        for b in bases:
            pts = [(_x(r, sweep), r[f"{b}_ms"]) for r in rows if r.get(f"{b}_ms") is not None]
            if not pts:
                continue
            name = labels.get(impl, impl) + (f" ({b})" if len(bases) > 1 else "")
            ax.plot(*zip(*pts), "o-" if b == "device" else "s--", color=COLORS.get(impl), label=name,
                    alpha=1.0 if b == "device" else 0.6)
            xs += [p[0] for p in pts]
    if not xs:
        return _nothing_to_show(ax, "no times to plot")
    gpu = results["mode"] == "gpu"
    what = {"device": "device time (CUDA graph)", "eager": "eager time (host included)",
            "both": "device and eager"}
    return _finish_line_plot(ax, results, sweep, xs, "ms per call" if gpu else "ms, interpreter wall-clock",
                             f"{pass_}, {what.get(basis, basis) if gpu else 'wall-clock'}",
                             legend=7 if len(bases) > 1 else 8)


def plot_speedups(results: dict, pass_: str = "fwd+bwd", sweep: str = "tokens",
                  basis: str = "device", ax=None):
    """Bars: ours' speed-up over each peer (peer time / ours) at each size; above the line at 1,
    ours is faster.

    Chapters 04 and 07 draw it.

    Args:
        results: a sweep's results dict.
        pass_: ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"``.
        sweep: ``"tokens"`` or ``"width"``.
        basis: ``"device"`` or ``"eager"``.
        ax: a matplotlib axes to draw on (None: a new figure).

    Returns:
        the axes.
    """
    ax = _new_axes(ax)
    labels = _labels(results)
    sizes = sorted({_x(r, sweep) for rows in sweep_rows(results, pass_, sweep).values() for r in rows})
    by_size = {}
    for e in speedups(results, basis):
        if e["pass"] == pass_:
            x = e["tokens"] if sweep == "tokens" else e["width"]
            if x in sizes:
                by_size[x] = e["speedup"]
    peers = sorted({k for s in by_size.values() for k in s})
    if not peers:
        return _nothing_to_show(ax, f"no {basis} times of ours and a peer to compare in these results")
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        xs = [j + (i - (len(peers) - 1) / 2) * width for j,
              s in enumerate(sizes) if peer in by_size.get(s, {})]
        ys = [by_size[s][peer] for s in sizes if peer in by_size.get(s, {})]
        ax.bar(xs, ys, width, color=COLORS.get(peer), label=f"vs {labels.get(peer, peer)}")
    ax.axhline(1.0, color="black", lw=1)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{s:,}" for s in sizes], rotation=45, ha="right")
    ax.set_xlabel(_xlabel(results, sweep))
    ax.set_ylabel(f"ours' speed-up ({basis} time)")
    ax.set_title(_title(results, f"speed-up of ours, {pass_}, {basis} time"), fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return ax


def plot_peak_memory(results: dict, pass_: str = "fwd+bwd", sweep: str = "tokens", ax=None):
    """Extra peak memory of one call (beyond its inputs) vs size, per implementation.

    Chapter 07 draws it.

    Args:
        results: a sweep's results dict.
        pass_: ``"fwd"``, ``"bwd"`` or ``"fwd+bwd"``.
        sweep: ``"tokens"`` or ``"width"``.
        ax: a matplotlib axes to draw on (None: a new figure).

    Returns:
        the axes.
    """
    ax = _new_axes(ax)
    labels, xs = _labels(results), []
    for impl, rows in sweep_rows(results, pass_, sweep).items():
        pts = [(_x(r, sweep),
                max(r["peak_extra_mib"], 0.01)) for r in rows if r["peak_extra_mib"] is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color=COLORS.get(impl), label=labels.get(impl, impl))
            xs += [p[0] for p in pts]
    if not xs:
        return _nothing_to_show(ax,
                                "no memory measurements in these results (the CPU keeps no allocator statistics)")
    return _finish_line_plot(ax, results, sweep, xs, "extra peak memory, MiB (log)",
                             f"extra peak memory, {pass_}")


def summary_figure(results: dict):
    """Four panels per kernel: what the command line saves as ``<kernel>/<gpu>.png``.

    Args:
        results: a sweep's results dict.

    Returns:
        the matplotlib ``Figure``.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 10), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    main_pass = "fwd+bwd"
    if results["kernel"] != "cross_entropy":  # memory-bound kernels measured in two passes: bandwidth first
        plot_bandwidth(results, main_pass, "tokens", axes[0])
        if results["settings"].get("width_sweep"):
            plot_bandwidth(results, main_pass, "width", axes[1])
        else:
            plot_bandwidth(results, "fwd", "tokens", axes[1])
        plot_speedups(results, main_pass, "tokens", "device", axes[2])
        plot_times(results, main_pass, "tokens", "both", axes[3])
    else:
        plot_times(results, main_pass, "tokens", "device", axes[0])
        plot_peak_memory(results, main_pass, "tokens", axes[1])
        plot_speedups(results, main_pass, "tokens", "device", axes[2])
        plot_bandwidth(results, main_pass, "tokens", axes[3])
    return fig


def save_summary_png(results: dict, path) -> Path:
    """Save ``summary_figure(results)`` as a PNG and return the path (a bare Figure: no display or
    pyplot needed).

    Args:
        results: a sweep's results dict.
        path: the PNG's path (its folder is created).

    Returns:
        the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    summary_figure(results).savefig(path, dpi=110)
    return path
