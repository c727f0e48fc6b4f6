"""The attention kernels' tile shapes, measured: ``python -m kernels.bench.attention_blocks``.

Each kernel of ``kernels.attention`` takes its tiles from ``attention_config``: query rows and keys
per tile, warps, and pipeline stages. That choice was made from FlashAttention-2's shapes, not from
a measurement. This command measures it, one kernel at a time, at one shape (default: Llama-3.1-8B's
attention, 32 query and 8 KV heads, d = 128, bf16, causal, 8,192 tokens, batch 2), with the other
kernels at their configured tiles:

* the forward, for each forward candidate;
* the backward (the delta preprocess, dK/dV, dQ), for each dK/dV candidate;
* the backward again, for each dQ candidate, beside the fastest dK/dV.

Before a candidate is timed its outputs are checked against the configured kernels' (relative error
within the tolerance of two implementations in the dtype): a tile shape that computes something else
is recorded as failing, never timed. One that does not compile on this GPU (more shared memory than
a block may have) is recorded with the reason. The first candidate of each list is the configured
one.

``--documents N`` times packed rows instead: each row holds documents of N tokens (position ids
restarting every N), as ``kernels.bench.attention``'s packed comparison does, with the package's
walk of packed rows.

The table gives each candidate's time against the configured one's. Choosing stays a person's
decision, written into ``attention_config`` with the run beside it (``assets/notes/attention.md``),
as for the other kernels' launch settings. Results: ``runs/attention_blocks/<gpu>.json``;
``--record`` writes ``assets/results/attention_blocks/<gpu>.json``. In the interpreter the shapes
and tiles are tiny and the timings mean nothing; the run checks that every candidate computes
attention.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kernels import attention, runtime
from kernels.attention import (
    BlockConfig,
    Config,
    attention_backward,
    attention_config,
    attention_forward,
    segment_bounds_from_positions,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

from . import cli
from .attention import document_positions, inputs
from .results import device_slug, first_line, results_file
from .timing import time_ms

GROUP = "attention_blocks"
GPU_SHAPE = dict(batch=2, heads=32, kv_heads=8, seq=8192, head_dim=128)
CPU_SHAPE = dict(batch=1, heads=2, kv_heads=1, seq=48, head_dim=16)

# (block_m, block_n, num_warps, num_stages[, Hopper flags]). The forward and dQ walks need block_m a
# multiple of block_n (their mask-free part ends at the query block's first row). Candidates from
# FlashAttention-2's and Triton's tutorial shapes around the configured ones, and small two-stage
# tiles for the short walks of packed documents; each list starts with what attention_config gives
# at d = 128 on Hopper. The flags switch on Hopper's machinery (Config.tma, tma_reduce, warp_specialize).
# "onepass" is the one-pass backward (dQ added as the dK/dV walk goes): its tiles are keys × query
# rows per step as for dK/dV.
TMA = {"tma": True}
TMA_WS = {"tma": True, "warp_specialize": True}
REDUCE = {"tma": True, "tma_reduce": True}
GPU_CANDIDATES = {
    "forward": [(128, 128, 8, 3, TMA), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2),
                (128, 64, 8, 4), (128, 64, 4, 3), (128, 32, 4, 3), (128, 32, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4),
                (64, 32, 4, 4),
                (64, 64, 4, 2), (64, 32, 4, 2),
                (128, 128, 8, 2, TMA), (128, 64, 8, 3, TMA), (128, 128, 8, 3, TMA_WS),
                (128, 128, 8, 2, TMA_WS), (128, 64, 4, 3, TMA_WS), (64, 64, 4, 2, TMA)],
    "dkdv": [(64, 64, 4, 2, TMA), (64, 64, 4, 2), (64, 64, 4, 3, TMA), (64, 128, 8, 2, TMA), (64, 64, 8, 2),
             (64, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3),
             (32, 128, 8, 3),
             (32, 64, 4, 3), (32, 64, 4, 4), (16, 128, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2),
             (64, 32, 4, 2)],
    "dq": [(64, 64, 4, 2, TMA), (64, 64, 4, 2), (64, 64, 4, 3, TMA), (128, 64, 8, 2, TMA), (128, 128, 8, 2, TMA),
           (64, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3), (128, 32, 8, 3),
           (64, 32, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)],
    "onepass": [(64, 128, 8, 2, REDUCE), (64, 128, 8, 2, TMA), (64, 128, 8, 2), (64, 128, 8, 3, REDUCE),
                (64, 128, 4, 2, REDUCE), (32, 128, 8, 2, REDUCE), (32, 128, 4, 3, REDUCE), (64, 64, 4, 2, REDUCE),
                (64, 64, 4, 3, REDUCE), (64, 64, 8, 2, REDUCE), (128, 128, 8, 2, REDUCE), (128, 64, 8, 2, REDUCE),
                (32, 64, 4, 3, REDUCE)],
}
CPU_CANDIDATES = {
    "forward": [(16, 16, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1, TMA)],
    "dkdv": [(16, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1, TMA)],
    "dq": [(16, 16, 4, 1), (32, 16, 4, 1, TMA)],
    "onepass": [(16, 32, 4, 1), (16, 16, 4, 1, TMA)],
}
KERNELS = ("forward", "dkdv", "dq", "onepass")
FLAGS = ("tma", "tma_reduce", "warp_specialize")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One tile to time, and the Hopper flags it runs with (``Config``'s fields of those names)."""

    block: BlockConfig
    flags: tuple[tuple[str, bool], ...] = ()


def candidates(kernel: str, props: runtime.DeviceProps | None = None) -> list[Candidate]:
    """The tiles tried for ``kernel`` (one of ``KERNELS``): the configured one first, then the others.

    Args:
        kernel: ``"forward"``, ``"dkdv"``, ``"dq"`` or ``"onepass"``.
        props: the device's properties (None: this machine's).

    Returns:
        the ``Candidate`` tiles, each with its flags.

    Raises:
        ValueError: when ``kernel`` is not one of ``KERNELS``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    table = CPU_CANDIDATES if (props or runtime.device_props()).interpreter else GPU_CANDIDATES
    return [Candidate(BlockConfig(*c[:4]), tuple(sorted(c[4].items())) if len(c) > 4 else ()) for c in table[kernel]]


def base_config(shape: dict) -> Config:
    """The configuration every row starts from: ``attention_config``'s on a GPU; in the interpreter
    the first candidates (``attention_config`` there gives one tile of up to 128 rows, which would
    walk no second block).

    Args:
        shape: the benchmark's shape (``seq``, ``head_dim``, ``documents``).

    Returns:
        the ``Config``.
    """
    if runtime.MODE == "gpu":
        return attention_config(shape["seq"], shape["head_dim"], packed=bool(shape.get("documents")))
    first = {k: candidates(k)[0].block for k in ("forward", "dkdv", "dq")}
    return Config(first["forward"], first["dkdv"], first["dq"], 16)


def configured(config: Config, kernel: str, props: runtime.DeviceProps | None = None) -> Candidate:
    """What ``config`` runs for ``kernel``, as a candidate.

    Args:
        config: the configuration.
        kernel: one of ``KERNELS``.
        props: the device's properties (None: this machine's), for the one pass's list.

    Returns:
        the ``Candidate`` (for "onepass" with no one-pass tile, the first of the list).
    """
    flags = {"forward": ("tma", "warp_specialize"), "onepass": ("tma", "tma_reduce")}.get(kernel, ("tma",))
    block = getattr(config, kernel)
    if block is None:
        return candidates(kernel, props)[0]
    return Candidate(block, tuple(sorted((f, getattr(config, f)) for f in flags if getattr(config, f))))


def _with(config: Config, kernel: str, candidate: Candidate) -> Config:
    # The flags a kernel does not read are reset, so that a row's flags are its own: the forward
    # reads tma and warp_specialize, the one pass tma and tma_reduce, the two backward kernels tma (both).
    own = {"forward": {"tma": False, "warp_specialize": False},
           "onepass": {"tma": False, "tma_reduce": False}}.get(kernel, {"tma": False})
    changes = {**own, **dict(candidate.flags), kernel: candidate.block}
    if kernel in ("dkdv", "dq"):
        changes["onepass"] = None  # the two-kernel backward
    return dataclasses.replace(config, **changes)


def measure_kernel(kernel: str, shape: dict, config: Config, blocks: list[Candidate],
                   scale: float) -> list[dict]:
    """One row per candidate tile of ``kernel``: checked against ``config``'s outputs, then timed
    (the forward alone, or the whole backward).

    Args:
        kernel: ``"forward"``, ``"dkdv"`` or ``"dq"``.
        shape: the benchmark's shape.
        config: the configuration the other kernels keep, and the reference's.
        blocks: the candidate tiles of ``kernel``, with their flags.
        scale: the softmax scale.

    Returns:
        one row per tile: its error and time, or ``failed`` and why.
    """
    dtype = torch.bfloat16 if runtime.MODE == "gpu" else torch.float32
    drawn = inputs(*(shape[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim")), dtype)
    q, k, v, grad = (t.detach() for t in drawn)  # the kernels are launched directly: no autograd here
    segments = packed_segments(shape, q.device)
    out, lse = attention_forward(q, k, v, True, scale, *segments, config=config)
    expected = (out, lse) if kernel == "forward" else attention_backward(grad, q, k, v, out, lse,
                                                                         True, scale,
                                                                     *segments, config=config)
    tol = 2 * RELATIVE_ERROR_TOL[q.dtype]
    rows = []
    if kernel == "onepass":  # the backward it would replace, as configured, timed first
        rows.append({"kernel": kernel, "block": None, "flags": {}, "baseline": True,
                     "ms": time_ms(lambda: attention_backward(grad, q, k, v, out, lse, True, scale, *segments,
                                                              config=config))})
    for candidate in blocks:
        row = {"kernel": kernel, "block": dataclasses.asdict(candidate.block), "flags": dict(candidate.flags)}
        cfg = _with(config, kernel, candidate)
        if kernel == "forward":
            def call(cfg=cfg):
                return attention_forward(q, k, v, True, scale, *segments, config=cfg)
        else:
            def call(cfg=cfg):
                return attention_backward(grad, q, k, v, out, lse, True, scale, *segments, config=cfg)
        try:
            error = max(relative_error(a, b, on_device=True) for a, b in zip(call(), expected))
            row["error"] = error
            if not error < tol:
                row["failed"] = f"disagrees with the configured tiles: relative error {error:.2e}"
            else:
                row["ms"] = time_ms(call)
        except Exception as exc:  # noqa: BLE001  (a tile this GPU cannot run, e.g. out of shared memory, is recorded)
            row["failed"] = first_line(exc)
        rows.append(row)
    return rows


def packed_segments(shape: dict, device) -> tuple:
    """(seg_start, seg_end) of packed rows with documents of ``shape["documents"]`` tokens, or ()
    for dense rows.

    Args:
        shape: the benchmark's shape.
        device: where the bounds live.

    Returns:
        the bounds, or ().
    """
    doc = shape.get("documents")
    if not doc:
        return ()
    return segment_bounds_from_positions(document_positions(shape["batch"], shape["seq"], doc, device))


def fastest(rows: list[dict]) -> dict | None:
    """The timed row with the least time, or None.

    Args:
        rows: rows of ``measure_kernel``.

    Returns:
        the row.
    """
    timed = [r for r in rows if "ms" in r and not r.get("baseline")]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def run(shape: dict | None = None, kernels=KERNELS) -> dict:
    """Every candidate of each of ``kernels`` at ``shape``; dQ's candidates run beside the fastest dK/dV.

    Chapter 16 shows the recorded sweeps.

    Args:
        shape: the benchmark's shape (None: the mode's).
        kernels: which of ``KERNELS`` to sweep.

    Returns:
        device, versions, settings, the configured tiles, every row and the fastest per kernel.
    """
    shape = dict(shape or (GPU_SHAPE if runtime.MODE == "gpu" else CPU_SHAPE))
    scale = 1.0 / shape["head_dim"] ** 0.5
    config = base_config(shape)
    result = {"device": runtime.device_name(), "device_slug": device_slug(), "mode": runtime.MODE,
              "versions": runtime.versions(), "kernel_version": attention.VERSION, "settings": {**shape,
              "causal": True, "dtype": "bfloat16" if runtime.MODE == "gpu" else "float32",
              "packed_interior": attention.PACKED_INTERIOR},
              "configured": dataclasses.asdict(config), "rows": [], "best": {}}
    for kernel in kernels:
        # first, whatever the configuration runs (packed rows have their own)
        first = configured(config, kernel)
        blocks = [first] + [c for c in candidates(kernel) if c != first]
        rows = measure_kernel(kernel, shape, config, blocks, scale)
        result["rows"] += rows
        best = fastest(rows)
        if best is not None:
            result["best"][kernel] = best
            if kernel == "dkdv":  # the dQ candidates are timed beside the fastest dK/dV
                config = _with(config, "dkdv", Candidate(BlockConfig(**best["block"]),
                                                         tuple(sorted(best["flags"].items()))))
    return result


def _label(row: dict) -> str:
    block = row["block"]
    if block is None:
        return f"{'the backward as configured':<38}"
    flags = " ".join(name for name, on in sorted(row.get("flags", {}).items()) if on)
    return f"{block['block_m']:>3}×{block['block_n']:<3} w{block['num_warps']} s{block['num_stages']} {flags:<20}"


def format_table(result: dict) -> str:
    """Every tile's time against the configured one, per kernel (chapter 16 prints it).

    Args:
        result: the dict of ``run``.

    Returns:
        the table, lines joined by newlines.
    """
    st = result["settings"]
    docs = f", packed documents of {st['documents']:,} tokens" if st.get("documents") else ""
    lines = [f"{result['device']}: attention tiles, batch {st['batch']}, {st['heads']}/{st['kv_heads']} heads, "
             f"seq {st['seq']:,}{docs}, d={st['head_dim']}, causal; time against the first (configured) tile of each"]
    for kernel in KERNELS:
        rows = [r for r in result["rows"] if r["kernel"] == kernel]
        if not rows:
            continue
        first = rows[0].get("ms")
        what = {"forward": "forward", "dkdv": "backward, dK/dV tiles", "dq": "backward, dQ tiles",
                "onepass": "one-pass backward (dQ added as the dK/dV walk goes)"}[kernel]
        lines.append(f"  {what}:")
        for r in rows:
            if "ms" in r:
                ratio = f"  {first / r['ms']:.2f}× the configured" if first else ""
                if kernel == "onepass" and first:
                    ratio = f"  {first / r['ms']:.2f}× the backward as configured"
                lines.append(f"    {_label(r)} {r['ms']:9.3f} ms{ratio}")
            else:
                lines.append(f"    {_label(r)}   failed: {r['failed']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.attention_blocks``.

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.attention_blocks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=cli.positive_int, default=None,
                        help="tokens per sequence (GPU default 8192)")
    parser.add_argument("--batch", type=cli.positive_int, default=None, help="sequences (GPU default 2)")
    parser.add_argument("--kernels", type=cli.names(KERNELS), default=KERNELS,
                        help=f"comma-separated subset of {','.join(KERNELS)}")
    parser.add_argument("--documents", type=cli.positive_int, default=None,
                        help="packed rows: documents of this many tokens each (default: dense rows)")
    cli.add_output_arguments(parser, f"{GROUP}/<gpu>[_documents<N>].json")
    return parser


def main(argv=None) -> int:
    """Sweep the tiles from the command line, print the table, write ``attention_blocks/<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    name = device_slug() + (f"_documents{args.documents}" if args.documents else "")
    path = results_file(GROUP, name, cli.output_root(args))
    shape = dict(GPU_SHAPE if runtime.MODE == "gpu" else CPU_SHAPE)
    shape.update({k: v for k, v in (("seq", args.seq), ("batch", args.batch), ("documents", args.documents))
                  if v is not None})
    problems = []
    if args.documents is not None and args.documents > shape["seq"]:
        problems.append(f"--documents {args.documents} is longer than a row of {shape['seq']} tokens (--seq): packed "
                        "rows hold documents no longer than the row")
    cli.check_outputs(parser, args, [path], problems)
    print(runtime.describe())
    result = run(shape, args.kernels)
    print(format_table(result))
    print("saved", cli.write_json(path, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
