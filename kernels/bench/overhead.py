"""Host overhead: the microseconds a Python caller spends per call besides the GPU's work (chapter 09).

Every kernel call costs twice. *Device time* is the GPU running the kernels. *Host time* is the CPU
getting them there: Python, PyTorch's operator dispatcher, autograd, allocations, and Triton's
launcher, which inspects every argument of every launch. On large tensors the device time dominates
and the host runs ahead; on small ones, or whenever the host cannot run ahead of the GPU, the caller
waits for the host.

``host_us`` measures host time as the per-call wall time of a long loop on tiny tensors, where the
device work is a few microseconds and the loop is bound by the host. ``measure_peers`` does that for
ours and every peer; ``breakdown`` splits ours, as its Python path runs, into layers by calling each
layer directly (on a GPU, the public functions of RMSNorm, SwiGLU and RoPE take their C++ node
instead, ``kernels.host_path``; ``measure_peers`` times
those):

    total           the Python autograd.Function, through autograd (``RMSNormFunction.apply(x, w, eps)`` and its
                    backward)
    impl            the Python launch functions behind the operators, no autograd.Function and no input checks
    launches        the Triton launches alone, with arguments and buffers prepared beforehand

so that autograd and checks = total − impl, our Python around the launches = impl − launches. An
eager call skips the dispatcher (``kernels.ops.call``); what the trip through it would cost, which a
traced or intercepted call still pays, is measured beside them: the operators called directly
(``ops``) minus ``impl``. ``floor`` times what no Python-level operator with Triton launches can go
below, on SwiGLU's tiny case: an ``autograd.Function`` that allocates its outputs and launches one
empty Triton kernel per pass, against PyTorch's C++ operators doing the whole of Hugging Face's
SwiGLU. ``python -m kernels.bench.overhead`` writes ``overhead/<device>.json`` and a PNG into the
runs folder (with ``--record``: into ``assets/results/``, where chapter 09 reads it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import triton

from kernels import runtime

from . import cli
from .peers import implementations
from .results import RESULTS, device_slug, first_line, results_file
from .sweep import CASES
from .timing import rotated

# Tiny calls: a few microseconds of GPU work, so a loop of them measures the host.
SHAPES = {"rmsnorm": (8, 1024), "cross_entropy": (8, 1024), "swiglu": (8, 1024), "rope": (8, 128)}
PASSES = {"rmsnorm": ("fwd", "fwd+bwd"), "cross_entropy": ("fwd+bwd",), "swiglu": ("fwd", "fwd+bwd"),
          "rope": ("fwd", "fwd+bwd")}
LAYERS = ("autograd and checks", "our Python around the launches", "Triton launches")


def _sync() -> None:
    if runtime.MODE == "gpu":
        torch.cuda.synchronize()


def host_us(fn: Callable[[], object], calls: int | None = None, warmup: int | None = None,
            grads=()) -> float:
    """Per-call wall time of ``calls`` back-to-back calls of ``fn``, in µs, synchronised before and after.

    ``grads``: tensors whose ``.grad`` is reset before each call (a backward then writes instead of
    accumulating). In the interpreter the number is the interpreter's Python, not a GPU's host
    overhead: a few calls only.

    Args:
        fn: the call to time, without arguments.
        calls: timed calls (None: the mode's default).
        warmup: untimed calls first (None: the mode's default).
        grads: tensors whose ``.grad`` is reset before each call.

    Returns:
        microseconds per call.
    """
    calls = calls or runtime.pick(5, 2000)
    warmup = runtime.pick(1, 100) if warmup is None else warmup
    for _ in range(warmup):
        for t in grads:
            t.grad = None
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        for t in grads:
            t.grad = None
        fn()
    _sync()
    return (time.perf_counter() - start) / calls * 1e6


def _case(kernel: str):
    return CASES[kernel](*SHAPES[kernel])


def interleaved_host_us(fns: dict[str, tuple[Callable[[], object], list]], calls: int | None = None,
                        rounds: int | None = None) -> dict[str, float]:
    """``host_us`` of every ``name: (fn, grads)``, taken in ``rounds`` rounds of ``calls / rounds``
    calls each, every function once per round in turn; the median per function.

    A host's speed drifts over seconds (another process, clock changes), so timing one function
    after another would charge the drift to whichever ran during it, and differences between them
    (the layers of ``breakdown``) could even come out negative. Interleaved, a slow stretch slows
    every function of that round alike. The order rotates from round to round, so that no function
    always runs first, or always right after the same neighbour.

    Args:
        fns: name -> ``(fn, grads)``.
        calls: calls per function in all (None: the mode's default).
        rounds: the rounds (None: the mode's default).

    Returns:
        name -> microseconds per call.
    """
    calls = calls or runtime.pick(5, 2000)
    rounds = rounds or runtime.pick(1, 10)
    per_round = max(1, calls // rounds)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            fn, grads = fns[name]
            times[name].append(host_us(fn, per_round, grads=grads))
    return {name: statistics.median(values) for name, values in times.items()}


def measure_peers(kernel: str, pass_: str, calls: int | None = None) -> list[dict]:
    """Host µs per call of every implementation of ``kernel`` (checked against float64 first), on a
    tiny case, timed in interleaved rounds (``interleaved_host_us``).

    Args:
        kernel: one of ``PASSES``'s kernels.
        pass_: the pass to time (``"fwd"`` or ``"fwd+bwd"``).
        calls: calls per implementation (None: the mode's default).

    Returns:
        one row per implementation, ``host_us`` None with a ``note`` where it was not timed.
    """
    case = _case(kernel)
    rows, timed = [], {}
    for impl in implementations(kernel):
        row = {"kernel": kernel, "pass": pass_, "impl": impl.key, "label": impl.label, "role": impl.role,
               "shape": list(SHAPES[kernel]), "host_us": None, "note": ""}
        rows.append(row)
        reason = impl.unavailable()
        if reason:
            row["note"] = reason
            continue
        try:
            fn, params = impl.build(case)
            case.reset_inputs()
            check = case.check(fn, params, pass_)
            if not check.ok:
                row["note"] = f"not timed: {check.message}"
                continue
            case.reset_inputs()
            call, grads = case.step(fn, params, pass_)
            # a trial call: one that fails is recorded here, for this peer
            host_us(call, 1, warmup=0, grads=grads)
            timed[impl.key] = (call, grads)
        except Exception as exc:  # noqa: BLE001  (a peer that fails here is a result, not the end of the run)
            row["note"] = f"{type(exc).__name__}: {first_line(exc)}"
    try:
        for key, us in interleaved_host_us(timed, calls).items():
            next(r for r in rows if r["impl"] == key)["host_us"] = us
    except Exception as exc:  # noqa: BLE001
        for row in rows:
            if row["impl"] in timed:
                row["note"] = f"timing raised {type(exc).__name__}: {first_line(exc)}"
    return rows


# --------------------------------------------------------------------------------------------------
# Ours, layer by layer
# --------------------------------------------------------------------------------------------------


def _rmsnorm_layers(case) -> dict[str, Callable[[], object]]:
    from kernels import rmsnorm as rms
    x, w, dy, eps = case.x, case.weight.clone().requires_grad_(), case.dy, case.eps
    xd = x.detach()
    y, rstd = rms.rms_norm_forward(xd, w.detach(), eps)
    rows, cols = xd.shape
    props = runtime.device_props(xd.device)
    fwd, bwd = rms.forward_config(rows, cols, props), rms.backward_config(rows, cols,
                                                                          xd.element_size(), props)
    dx, dw = torch.empty_like(xd), torch.empty_like(w)
    partial = torch.empty((bwd.grid[0], cols), dtype=torch.float32, device=xd.device)

    def total():
        # The Python path, whose layers these are; on a GPU ``rms_norm`` itself runs the C++ node.
        x.grad = w.grad = None
        rms.RMSNormFunction.apply(x, w, eps).backward(dy)

    def ops():
        y, rstd = rms.rms_norm_fwd_op(xd, w.detach(), eps)
        rms.rms_norm_bwd_op(dy, xd, w.detach(), rstd, True)

    def impl():
        y, rstd = rms.rms_norm_forward(xd, w.detach(), eps)
        rms.rms_norm_backward(dy, xd, w.detach(), rstd, True)

    def launches():
        rms.rms_norm_fwd_kernel[fwd.grid](xd, w, y, rstd, rows, cols, cols, cols, eps,
                                          ROWS=fwd.rows, BLOCK_N=fwd.block_n, num_warps=fwd.num_warps)
        rms.rms_norm_bwd_kernel[bwd.grid](xd, w, dy, rstd, dx, partial, rows, cols, cols, cols, cols,
                                          ROWS=bwd.rows, BLOCK_N=bwd.block_n, COMPUTE_DW=True,
                                          STAGES=bwd.stages,
                                          num_warps=bwd.num_warps)
        rms.rms_norm_dw_kernel[bwd.dw_grid](partial, dw, bwd.grid[0], cols, BLOCK_P=bwd.dw_block_p,
                                            BLOCK_C=bwd.dw_block_c, num_warps=4)

    return {"total": total, "ops": ops, "impl": impl, "launches": launches, "n_launches": 3}


def _cross_entropy_layers(case) -> dict[str, Callable[[], object]]:
    from kernels.cross_entropy import (
        backward_config,
        cross_entropy,
        cross_entropy_fwd_inplace_op,
        cross_entropy_scale_grad_op,
        cross_entropy_setup_kernel,
        forward_config,
        launch_forward,
        row_layout,
        scale_grad_kernel,
    )
    from kernels.ops import implementation

    logits, target = case.logits, case.target
    work = logits.detach().clone()
    one = torch.ones((), device=work.device)
    layout = row_layout(work, True)
    cfg = forward_config(layout.n_rows, layout.n_cols, runtime.device_props(work.device))
    bwd = backward_config(layout.n_rows, layout.n_cols, runtime.device_props(work.device))
    forward_impl = implementation(cross_entropy_fwd_inplace_op)
    scale_grad_impl = implementation(cross_entropy_scale_grad_op)
    loss_rows = torch.empty(layout.n_rows, device=work.device)
    lse, out = torch.empty_like(loss_rows), torch.empty((), device=work.device)
    scale = torch.empty(2, device=work.device)
    block = min(triton.next_power_of_2(layout.n_rows), 4096)

    def total():
        logits.grad = None
        cross_entropy(logits, target, inplace_backward=True, check_targets=False).backward()

    def ops():
        cross_entropy_fwd_inplace_op(work, target, -100, "mean", None, None)
        cross_entropy_scale_grad_op(work, one)

    def impl():
        forward_impl(work, target, -100, "mean", None, None)
        scale_grad_impl(work, one)

    def launches():
        cross_entropy_setup_kernel[(1,)](target, scale, scale, layout.n_rows, -100, 1.0, MODE=0, BLOCK=block)
        launch_forward(layout, target, loss_rows, lse, layout, scale, out, -100, cfg)
        scale_grad_kernel[(triton.cdiv(layout.n_rows, bwd.rows),)](
            work, one, layout.n_rows, layout.n_cols, layout.inner_rows, layout.stride_outer,
            layout.stride_inner, 0,
            ROWS=bwd.rows, BLOCK_V=bwd.block_v, num_warps=bwd.num_warps)

    return {"total": total, "ops": ops, "impl": impl, "launches": launches, "n_launches": 4}


def _swiglu_layers(case) -> dict[str, Callable[[], object]]:
    from kernels.swiglu import (
        SwiGLUFunction,
        backward_config,
        forward_config,
        launch_backward,
        swiglu_backward,
        swiglu_bwd_op,
        swiglu_forward,
        swiglu_fwd_kernel,
        swiglu_fwd_op,
    )

    gate, up, dy = case.gate, case.up, case.dy
    g, u = gate.detach(), up.detach()
    rows, cols = g.shape
    props = runtime.device_props(g.device)
    fwd, bwd = forward_config(rows, cols, props), backward_config(rows, cols, props)
    y, d_gate, d_up = torch.empty_like(g), torch.empty_like(g), torch.empty_like(u)

    def total():
        # The Python path, whose layers these are; on a GPU ``swiglu`` itself runs the C++ node
        # (``floor``).
        gate.grad = up.grad = None
        SwiGLUFunction.apply(gate, up, False).backward(dy)

    def ops():
        swiglu_fwd_op(g, u)
        swiglu_bwd_op(dy, g, u)

    def impl():
        swiglu_forward(g, u)
        swiglu_backward(dy, g, u)

    def launches():
        swiglu_fwd_kernel[fwd.grid](g, u, y, rows, cols, cols, cols, cols, ROWS=fwd.rows,
                                    BLOCK_N=fwd.block_n,
                                    num_warps=fwd.num_warps)
        launch_backward(dy, g, u, d_gate, d_up, rows, cols, (cols,) * 5, bwd)

    return {"total": total, "ops": ops, "impl": impl, "launches": launches, "n_launches": 2}


def _rope_layers(case) -> dict[str, Callable[[], object]]:
    from kernels import rope
    q, k, cos, sin, dq, dk = case.q, case.k, case.cos, case.sin, case.dq, case.dk
    qd, kd = q.detach(), k.detach()
    q_out, k_out = torch.empty_like(qd), torch.empty_like(kd)
    dq_in, dk_in = torch.empty_like(qd), torch.empty_like(kd)

    def total():
        # The Python path, whose layers these are; on a GPU ``apply_rotary`` itself runs the C++
        # node.
        q.grad = k.grad = None
        torch.autograd.backward(list(rope.RotaryFunction.apply(q, k, cos, sin)), [dq, dk])

    def ops():
        rope.rope_fwd_op(qd, kd, cos, sin)
        rope.rope_bwd_op(dq, dk, cos, sin, qd.dtype, True)

    def impl():
        rope.rope_forward(qd, kd, cos, sin)
        rope.rope_backward(dq, dk, cos, sin, qd.dtype, True)

    def launches():
        rope.launch(qd, kd, cos, sin, q_out, k_out, False, None)
        rope.launch(dq, dk, cos, sin, dq_in, dk_in, True, None)

    return {"total": total, "ops": ops, "impl": impl, "launches": launches, "n_launches": 2}


_LAYERS_OF = {"rmsnorm": _rmsnorm_layers, "cross_entropy": _cross_entropy_layers, "swiglu": _swiglu_layers,
              "rope": _rope_layers}


def breakdown(kernel: str, calls: int | None = None) -> dict:
    """Our forward + backward of ``kernel`` on a tiny case, split into ``LAYERS`` (µs per call), and
    the operator dispatch that an eager call skips (``dispatch_skipped_us``).

    Chapter 09 shows it, through ``run`` and ``plot``.

    Args:
        kernel: one of ``PASSES``'s kernels.
        calls: calls per layer (None: the mode's default).

    Returns:
        the levels' and parts' microseconds, the dispatch skipped and the launches.
    """
    case = _case(kernel)
    layers = _LAYERS_OF[kernel](case)
    t = interleaved_host_us({name: (layers[name], []) for name in ("total", "ops", "impl",
                                                                   "launches")}, calls)
    parts = {
        "autograd and checks": t["total"] - t["impl"],
        "our Python around the launches": t["impl"] - t["launches"],
        "Triton launches": t["launches"],
    }
    return {"kernel": kernel, "shape": list(SHAPES[kernel]), "levels_us": t, "parts_us": parts,
            "dispatch_skipped_us": t["ops"] - t["impl"],
            "n_launches": layers["n_launches"], "per_launch_us": t["launches"] / layers["n_launches"]}


# --------------------------------------------------------------------------------------------------
# The floor of a Python-level operator
# --------------------------------------------------------------------------------------------------


@triton.jit
def _nothing_kernel(X):
    pass


class _EmptyFunction(torch.autograd.Function):
    """SwiGLU's host path with the work taken out: outputs allocated and inputs saved as ours does,
    and ``launches`` empty Triton launches per pass (0 or 1). Its outputs hold whatever memory they
    were given."""

    @staticmethod
    def forward(ctx, gate, up, launches):
        ctx.save_for_backward(gate, up)
        ctx.launches = launches
        y = torch.empty_like(gate)
        if launches:
            _nothing_kernel[(1,)](y)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        if ctx.launches:
            _nothing_kernel[(1,)](d_gate)
        return d_gate, d_up, None


FLOOR = ("Hugging Face's SwiGLU, C++ operators", "autograd.Function, no kernel",
         "autograd.Function, one empty Triton launch per pass", "ours, Python path", "ours")


def floor(calls: int | None = None) -> dict[str, float]:
    """Host µs per forward + backward on SwiGLU's tiny case, timed in interleaved rounds: Hugging
    Face's ``F.silu(gate) * up`` (three C++ autograd nodes, five kernels), ``_EmptyFunction``
    without and with its two empty launches, ours through its Python ``autograd.Function``, and ours
    as called (on a GPU, the C++ node of ``kernels.host_path`` where it is built). The third is the
    least any Python ``autograd.Function`` with a Triton kernel per pass can cost on this host,
    whatever its kernels do.

    Args:
        calls: calls per function (None: the mode's default).

    Returns:
        name (from ``FLOOR``) -> microseconds per call.
    """
    case = _case("swiglu")
    gate, up, dy = case.gate, case.up, case.dy
    from kernels.swiglu import SwiGLUFunction, swiglu

    fns = {
        FLOOR[0]: lambda: (torch.nn.functional.silu(gate) * up).backward(dy),
        FLOOR[1]: lambda: _EmptyFunction.apply(gate, up, 0).backward(dy),
        FLOOR[2]: lambda: _EmptyFunction.apply(gate, up, 1).backward(dy),
        FLOOR[3]: lambda: SwiGLUFunction.apply(gate, up, False).backward(dy),
        FLOOR[4]: lambda: swiglu(gate, up).backward(dy),
    }
    return interleaved_host_us({name: (fn, [gate, up]) for name, fn in fns.items()}, calls)


# --------------------------------------------------------------------------------------------------
# A whole run: results, table, plot
# --------------------------------------------------------------------------------------------------


def run(calls: int | None = None) -> dict:
    """Every kernel and pass: peers' host µs, our breakdown and the floor, with the device and
    versions it ran on.

    Chapter 09 runs it.

    Args:
        calls: calls per measurement (None: the mode's default).

    Returns:
        device, versions, the peers' rows, the breakdowns and ``floor_us``.
    """
    results = {"device": runtime.device_name(), "device_slug": device_slug(), "mode": runtime.MODE,
               "versions": runtime.versions(), "calls": calls or runtime.pick(5, 2000), "peers": [],
               "breakdown": {}}
    for kernel, passes in PASSES.items():
        for pass_ in passes:
            results["peers"] += measure_peers(kernel, pass_, calls)
        results["breakdown"][kernel] = breakdown(kernel, calls)
    results["floor_us"] = floor(calls)
    return results


def format_table(results: dict) -> str:
    """The results as text: each peer's host time, our breakdown per kernel, the floor (chapter 09).

    Args:
        results: the dict of ``run``.

    Returns:
        the table, lines joined by newlines.
    """
    lines = [f"host time per call, µs ({results['device']}, tiny tensors)"]
    for row in results["peers"]:
        value = f"{row['host_us']:8.1f}" if row["host_us"] is not None else "       —"
        lines.append(f"  {row['kernel']:<14}{row['pass']:<9}{value}  {row['label']}  {row['note']}".rstrip())
    for kernel, b in results["breakdown"].items():
        parts = ", ".join(f"{name} {us:.1f}" for name, us in b["parts_us"].items())
        lines.append(f"  ours through Python, {kernel} fwd+bwd = {b['levels_us']['total']:.1f} µs: {parts} "
                     f"(operator dispatch skipped: {b['dispatch_skipped_us']:.1f})")
    if results.get("floor_us"):
        lines.append("  the floor, SwiGLU's tiny case, forward + backward:")
        lines += [f"    {us:8.1f}  {name}" for name, us in results["floor_us"].items()]
    return "\n".join(lines)


def plot(results: dict, ax=None):
    """Stacked bars: where the microseconds of our Python path go, next to the fastest peer's total,
    per kernel; on SwiGLU's bar, dashed, the floor of a Python-level operator, and what ours costs
    as called (``floor``).

    Chapter 09 draws it.

    Args:
        results: the dict of ``run``.
        ax: a matplotlib axes to draw on (None: a new figure).

    Returns:
        the axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = ["#9467bd", "#ff7f0e", "#d62728"]
    names = list(results["breakdown"])
    for i, kernel in enumerate(names):
        left = 0.0
        for name, color in zip(LAYERS, colors):
            width = max(0.0, results["breakdown"][kernel]["parts_us"][name])
            ax.barh(i, width, left=left, color=color, label=name if i == 0 else None)
            left += width
        peers = [r for r in results["peers"] if r["kernel"] == kernel and r["pass"] == "fwd+bwd"
                 and r["role"] == "peer" and r["host_us"] is not None]
        if peers:
            best = min(peers, key=lambda r: r["host_us"])
            ax.plot([best["host_us"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
            ax.annotate(best["label"], (best["host_us"], i + 0.42), fontsize=8, ha="center", va="bottom")
        if kernel == "swiglu" and results.get("floor_us"):
            least = results["floor_us"][FLOOR[2]]
            ax.plot([least] * 2, [i - 0.4, i + 0.4], color="white", lw=2, ls=(0, (2, 2)))
            text = "dashed: an empty autograd.Function\nwith one Triton launch per pass"
            if FLOOR[4] in results["floor_us"]:
                text += f"\nours as called: {results['floor_us'][FLOOR[4]]:.0f} µs"
            ax.annotate(text, (max(left, least) * 1.02, i), fontsize=7.5, ha="left", va="center")
    ax.set_yticks(range(len(names)), [f"{k}\nfwd+bwd" for k in names])
    ax.set_xlabel("host time per call (µs)")
    ax.set_title(f"Where the microseconds go ({results['device']})", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    return ax


def save(results: dict, directory=RESULTS) -> tuple:
    """Write ``overhead/<device>.json`` and ``.png`` under the results root ``directory`` (each
    complete or not at all); returns both paths.

    Args:
        results: the dict of ``run``.
        directory: the results root.

    Returns:
        ``(json_path, png_path)``.
    """
    import matplotlib.pyplot as plt

    path = results_file("overhead", results["device_slug"], directory)
    ax = plot(results)
    ax.figure.tight_layout()
    png = cli.write_json_and_figure(path, results, ax.figure, path.with_suffix(".png"), dpi=120)[1]
    plt.close(ax.figure)
    return path, png


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.overhead``.

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=cli.positive_int, default=None,
                        help="calls per measurement (default 2000 on a GPU)")
    cli.add_output_arguments(parser, "overhead/<device>.json and .png")
    parser.add_argument("--no-save", action="store_true", help="print only; write no JSON or PNG")
    return parser


def main(argv=None) -> int:
    """Measure from the command line, print the table, write ``overhead/<device>.json`` and ``.png``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    targets = [] if args.no_save else [results_file("overhead", device_slug(), cli.output_root(args), suffix)
                                       for suffix in (".json", ".png")]
    cli.check_outputs(parser, args, targets)
    print(runtime.describe())
    results = run(args.calls)
    print(format_table(results))
    if not args.no_save:
        print("saved", *save(results, cli.output_root(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
