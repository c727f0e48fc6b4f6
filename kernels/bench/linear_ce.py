"""The linear cross-entropy benchmark: the loss of an LM head, forward + backward, every peer side by side
(``python -m kernels.bench.linear_ce``).

Unlike RMSNorm and the cross-entropy of given logits, this loss is bound by its matrix multiplies,
not by memory: the floor of a step is 3 matmuls of 2·tokens·vocab·hidden FLOP (the logits, d_hidden,
d_weight) at the measured bf16 matmul rate, and the other axis is memory: the peak a step adds
beyond its inputs and the two gradients.

Peers, each building ``fn(hidden, weight, target) -> loss`` on the same inputs:

* ``torch-fp32``: ``hidden @ weight.T`` then ``F.cross_entropy(logits.float())``, what Hugging Face
  computes;
* ``torch-bf16``: the same without the float32 upcast;
* ``compile``: ``torch.compile`` of ``torch-fp32`` (GPU only);
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (token chunks, gradient during the
  forward);
* ``cce``, ``cce-exact``: Apple's Cut Cross-Entropy ``linear_cross_entropy`` (fused matmul and
  log-sum-exp, recompute), with its default gradient filter and without it;
* ``trl``: TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``, what ``SFTTrainer`` trains
  with: tiles of 4,096 tokens × 32,768 vocabulary columns, recompute in the backward), on the
  positions that count, as TRL calls it;
* ``ours`` (``strategy="auto"``: "recompute" for a trainable weight, keeping the logits its memory
  budget allows), ``ours-recompute-all`` (the same keeping none: every slice recomputed) and
  ``ours-chunked``.

Every implementation is checked against a float32 reference
(``reference.linear_cross_entropy_reference``) before it is timed; one that fails is recorded and
not timed. Times are ``eager_ms`` (the Python call) and ``device_ms`` (a CUDA graph's replay, where
the implementation allows capture), as in ``kernels.bench.sweep``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.linear_cross_entropy import linear_cross_entropy
from kernels.reference import linear_cross_entropy_reference, relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

from . import cli
from .results import RESULTS, device_slug, first_line, load_ceilings, results_file
from .timing import device_time_ms, peak_extra_mib, time_ms

KERNEL = "linear_cross_entropy"
GPU_SIZES = dict(tokens=(1024, 2048, 4096, 8192, 16384), hidden=4096, vocab=128_256)
CPU_SIZES = dict(tokens=(8, 24), hidden=32, vocab=500)


@dataclass(frozen=True)
class LinearImpl:
    """One implementation: ``build()`` returns ``fn(hidden, weight, target) -> loss``;
    ``unavailable()`` says why it cannot run here, or None. ``capturable=False``: the call
    synchronises with the host, so no CUDA graph is tried (a capture that fails part-way can leave
    PyTorch's CUDA random generator unusable for the rest of the process)."""

    key: str
    label: str
    build: Callable[[], Callable]
    unavailable: Callable[[], str | None] = lambda: None
    capturable: bool = True


def _torch_loss(upcast: bool) -> Callable:
    def fn(hidden, weight, target):
        logits = hidden @ weight.T
        return F.cross_entropy(logits.float() if upcast else logits, target)

    return fn


def _gpu_only(what: str) -> Callable[[], str | None]:
    def reason():
        return None if runtime.MODE == "gpu" else f"{what} runs only on a GPU"

    return reason


def _package(module: str, pip_name: str, gpu_only: bool = True) -> Callable[[], str | None]:
    def reason():
        try:
            __import__(module)
        except ImportError as exc:
            return f"{pip_name} is not installed here ({first_line(exc)}): `pip install {pip_name}` to compare"
        return _gpu_only(pip_name)() if gpu_only else None

    return reason


def _liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, target: loss(weight, hidden, target)


def _cce(**options) -> Callable[[], Callable]:
    def build():
        from cut_cross_entropy import linear_cross_entropy as cce

        return lambda hidden, weight, target: cce(hidden, weight, target, **options)

    return build


def _trl():
    from trl.kernels import ChunkedLogProbFunction

    def fn(hidden, weight, target):
        # As TRL's SFTTrainer calls it: only the positions that count are projected (a boolean
        # index, so a host synchronisation), per-token log-probabilities summed and divided by their
        # number.
        counted = target != -100
        log_probs = ChunkedLogProbFunction.apply(hidden[counted], weight, None, target[counted],
                                                 1.0, 32768, None,
                                                 1.0, ())[0]
        return -log_probs.sum() / counted.sum()

    return fn


def _ours(strategy: str, keep_logits: bool = True) -> Callable[[], Callable]:
    return lambda: (lambda hidden, weight,
                    target: linear_cross_entropy(hidden, weight, target, strategy=strategy,
                                                                       check_targets=False,
                                                                       keep_logits=keep_logits))


IMPLS = (
    LinearImpl("ours", "ours (auto: recompute)", _ours("auto")),
    LinearImpl("ours-recompute-all", "ours, recompute, no logits kept",
               _ours("recompute", keep_logits=False)),
    LinearImpl("ours-chunked", "ours, chunked", _ours("chunked")),
    LinearImpl("torch-fp32", "matmul + F.cross_entropy(fp32) (HF)", lambda: _torch_loss(True)),
    LinearImpl("torch-bf16", "matmul + F.cross_entropy(bf16)", lambda: _torch_loss(False)),
    LinearImpl("compile", "torch.compile(matmul + fp32 CE)", lambda: torch.compile(_torch_loss(True)),
               _gpu_only("torch.compile (inductor)")),
    LinearImpl("liger", "Liger fused linear CE", _liger, _package("liger_kernel", "liger-kernel"),
               capturable=False),
    LinearImpl("cce", "Cut Cross-Entropy (default: filtered gradient)", _cce(),
               _package("cut_cross_entropy", "cut-cross-entropy")),
    # Cut Cross-Entropy skips gradient blocks it deems negligible by default; without that filter it
    # is exact.
    LinearImpl("cce-exact", "Cut Cross-Entropy, no gradient filter", _cce(filter_eps=None),
               _package("cut_cross_entropy", "cut-cross-entropy")),
    LinearImpl("trl", "TRL fused LM head (SFTTrainer)", _trl, _package("trl.kernels", "trl", gpu_only=False),
               capturable=False),
)


def make_inputs(tokens: int, hidden: int, vocab: int, dtype=torch.bfloat16, seed: int = 0,
                ignored: float = 0.1):
    """Hidden states, an LM head weight (scaled as a trained one: logits of a few units) and
    targets, a share of them ignored, on this machine's device.

    Args:
        tokens: rows of the hidden states.
        hidden: the hidden size.
        vocab: the vocabulary size.
        dtype: the inputs' dtype.
        seed: the seed.
        ignored: the share of targets set to -100.

    Returns:
        ``(hidden_states, weight, targets)``, the first two requiring gradients.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    device = runtime.device()
    h = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * (2.0 / hidden**0.5)).to(device, dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[torch.rand(tokens, generator=g) < ignored] = -100
    return h, w, t.to(device)


def matmul_flop(tokens: int, hidden: int, vocab: int) -> int:
    """The FLOP of the unfused loss's three matmuls (logits, d_hidden, d_weight): the floor every
    plan is judged by.

    Chapter 10 uses it.

    Args:
        tokens: rows of the hidden states.
        hidden: the hidden size.
        vocab: the vocabulary size.

    Returns:
        the FLOP count.
    """
    return 3 * 2 * tokens * hidden * vocab


def check(fn, h, w, t, expected) -> dict:
    """Relative errors of the loss and both gradients against ``expected`` = (loss, d_hidden, d_weight).

    Args:
        fn: ``fn(hidden, weight, targets)`` returns the loss.
        h: the hidden states.
        w: the LM head's weight.
        t: the targets.
        expected: the reference ``(loss, d_hidden, d_weight)``.

    Returns:
        ``{"errors", "ok"}``: the three relative errors, and whether all are within the dtype's bound.
    """
    h.grad = w.grad = None
    loss = fn(h, w, t)
    loss.backward()
    errors = {"loss": relative_error(loss.detach(), expected[0], on_device=True),
              "d_hidden": relative_error(h.grad, expected[1], on_device=True),
              "d_weight": relative_error(w.grad, expected[2], on_device=True)}
    h.grad = w.grad = None
    tol = RELATIVE_ERROR_TOL[h.dtype]
    return {"errors": errors, "ok": all(e < tol for e in errors.values())}


def measure(impl: LinearImpl, tokens: int, hidden: int, vocab: int, ceilings: dict | None) -> dict:
    """Check, then time, one implementation at one size.

    Args:
        impl: the implementation.
        tokens: rows of the hidden states.
        hidden: the hidden size.
        vocab: the vocabulary size.
        ceilings: the GPU's ceilings (None: no share of the matmul ceiling).

    Returns:
        the row: times, extra memory and check, or ``skipped`` and why.
    """
    row = {"impl": impl.key, "label": impl.label, "tokens": tokens, "hidden": hidden, "vocab": vocab}
    reason = impl.unavailable()
    if reason:
        return {**row, "skipped": reason}
    h, w, t = make_inputs(tokens, hidden, vocab)
    expected = linear_cross_entropy_reference(h, w, t, dtype=torch.float32)
    fn = impl.build()
    try:
        row["check"] = check(fn, h, w, t, expected)
    except Exception as exc:  # noqa: BLE001  (a peer that fails at this size is a result, not a crash)
        return {**row, "skipped": f"failed: {type(exc).__name__}: {first_line(exc)}"}
    del expected
    if not row["check"]["ok"]:
        return row

    def step():
        fn(h, w, t).backward()

    row["eager_ms"] = time_ms(step, warmup=5, rep=20, grad_to_none=[h, w])
    if impl.capturable:
        row["device_ms"], row["device_note"] = device_time_ms(step, grad_to_none=[h, w], warmup=5, rep=20)
    else:
        row["device_ms"], row["device_note"] = None, "synchronises with the host: no CUDA graph (eager time only)"
    peak = peak_extra_mib(step, grad_to_none=[h, w])
    gradients_mib = (h.numel() + w.numel()) * h.element_size() / 2**20
    # beyond the two gradients every plan writes
    row["extra_mib"] = None if peak is None else peak - gradients_mib
    if ceilings and row.get("device_ms"):
        tflops = matmul_flop(tokens, hidden, vocab) / (row["device_ms"] * 1e-3) / 1e12
        row["tflops_of_3_matmuls"] = tflops
        row["fraction_of_matmul_ceiling"] = tflops / ceilings["matmul_tflops"]
    return row


def run(tokens=None, hidden=None, vocab=None, keys=None, progress: bool = True) -> dict:
    """Every implementation (or those in ``keys``) at every token count; the results as a dict (see
    ``save``).

    Chapter 10 runs it.

    Args:
        tokens: token counts (None: the mode's sizes).
        hidden: the hidden size (None: the mode's).
        vocab: the vocabulary size (None: the mode's).
        keys: implementation keys (None: all).
        progress: show a progress bar.

    Returns:
        device, versions, ceilings, sizes and one row per (token count, implementation).
    """
    sizes = GPU_SIZES if runtime.MODE == "gpu" else CPU_SIZES
    tokens, hidden, vocab = tokens or sizes["tokens"], hidden or sizes["hidden"], vocab or sizes["vocab"]
    impls = [i for i in IMPLS if keys is None or i.key in keys]
    ceilings = load_ceilings() if runtime.MODE == "gpu" else None
    from tqdm.auto import tqdm

    rows = []
    for n in tqdm(tokens, desc="tokens", disable=not progress):
        for impl in impls:
            rows.append(measure(impl, n, hidden, vocab, ceilings))
            if runtime.MODE == "gpu":
                torch.cuda.empty_cache()
    return {"kernel": KERNEL, "device": runtime.device_name(), "device_slug": device_slug(),
            "mode": runtime.MODE,
            "versions": runtime.versions(), "ceilings": ceilings, "hidden": hidden, "vocab": vocab,
            "tokens": list(tokens), "rows": rows, "note": runtime.timings_note()}


def table(results: dict) -> str:
    """The rows as a text table: time (eager and device), extra memory, share of the matmul ceiling.

    Chapter 10 prints it.

    Args:
        results: the dict of ``run``.

    Returns:
        the table, lines joined by newlines.
    """
    lines = [f"{'tokens':>7} {'implementation':<38} {'eager ms':>9} {'device ms':>9} {'extra MiB':>10} {'of mm':>6}"]
    for r in results["rows"]:
        if "skipped" in r or not r.get("check", {}).get("ok"):
            why = r.get("skipped") or f"WRONG {r['check']['errors']}"
            lines.append(f"{r['tokens']:>7} {r['label']:<38} {why[:70]}")
            continue
        frac = r.get("fraction_of_matmul_ceiling")
        lines.append(
            f"{r['tokens']:>7} {r['label']:<38} {r['eager_ms']:>9.2f} "
            f"{r['device_ms'] if r.get('device_ms') is not None else float('nan'):>9.2f} "
            f"{r['extra_mib'] if r.get('extra_mib') is not None else float('nan'):>10.0f} "
            f"{f'{frac:.0%}' if frac else '—':>6}"
        )
    return "\n".join(lines)


def plot(results: dict, axes=None):
    """Time and extra memory against tokens, one line per implementation.

    Chapter 10 draws it.

    Args:
        results: the dict of ``run``.
        axes: two matplotlib axes to draw on (None: a new figure).

    Returns:
        the two axes.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    timed = [r for r in results["rows"] if r.get("eager_ms") is not None]
    for key in dict.fromkeys(r["impl"] for r in timed):
        rows = [r for r in timed if r["impl"] == key]
        x = [r["tokens"] for r in rows]
        y = [r["device_ms"] if r.get("device_ms") is not None else r["eager_ms"] for r in rows]
        axes[0].plot(x, y, "o-", label=rows[0]["label"])
        if all(r.get("extra_mib") is not None for r in rows):
            axes[1].plot(x, [r["extra_mib"] for r in rows], "o-", label=rows[0]["label"])
    basis = "device time" if results["mode"] == "gpu" else "interpreter wall-clock (not GPU speed)"
    axes[0].set(xscale="log", yscale="log", xlabel="tokens", ylabel=f"ms, forward + backward ({basis})",
                title=f"H={results['hidden']:,}, V={results['vocab']:,} — {results['device']}")
    axes[1].set(xscale="log", yscale="symlog", xlabel="tokens", ylabel="MiB beyond inputs and gradients",
                title="extra peak memory" + ("" if results["mode"] == "gpu" else " (GPU only)"))
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return axes


def save(results: dict, out: Path = RESULTS) -> tuple[Path, Path]:
    """``linear_cross_entropy/<device>.json`` and ``.png`` under the results root ``out``.

    Args:
        results: the dict of ``run``.
        out: the results root.

    Returns:
        ``(json_path, png_path)``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    json_path = results_file(KERNEL, results["device_slug"], out)
    png_path = results_file(KERNEL, results["device_slug"], out, suffix=".png")
    axes = plot(results)
    axes[0].figure.tight_layout()
    cli.write_json_and_figure(json_path, results, axes[0].figure, png_path, dpi=120)
    plt.close(axes[0].figure)
    return json_path, png_path


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.linear_ce``.

    Returns:
        the parser.
    """
    p = argparse.ArgumentParser(prog="python -m kernels.bench.linear_ce", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=cli.positive_ints, default=None, help="token counts, e.g. 2048,8192")
    p.add_argument("--hidden", type=cli.positive_int, default=None,
                   help="hidden width (default 4096 on a GPU)")
    p.add_argument("--vocab", type=cli.positive_int, default=None,
                   help="vocabulary (default 128,256 on a GPU)")
    p.add_argument("--impls", type=cli.names(i.key for i in IMPLS), default=None,
                   help=f"comma-separated, from {', '.join(i.key for i in IMPLS)}")
    cli.add_output_arguments(p, f"{KERNEL}/<device>.json and .png")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    """Check and time the plans from the command line, print the table, write the JSON and PNG.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    p = build_parser()
    args = p.parse_args(argv)
    root = cli.output_root(args)
    cli.check_outputs(p, args,
                      [results_file(KERNEL, device_slug(), root, suffix) for suffix in (".json", ".png")])
    print(runtime.describe())
    results = run(args.tokens, args.hidden, args.vocab, args.impls, progress=not args.no_progress)
    print(table(results))
    paths = save(results, root)
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
