"""Attention forward + backward: ours against SDPA (flash, cuDNN), compiled flex_attention, and
packed documents.

``python -m kernels.bench.attention`` measures, at Llama-3.1-8B's attention (32 query heads, 8 KV
heads, head dim 128, bf16, causal) with 16,384 tokens per batch (batch = 16,384 / seq) at seq 2,048,
8,192 and 32,768
(``--seqs`` adds 131,072):

* dense causal attention: ours (``kernels.flash_attention``), SDPA's flash kernel
  (FlashAttention-2), SDPA's cuDNN kernel, and ``flex_attention`` compiled with a causal
  ``BlockMask``;
* packed documents of 1,024 tokens: ours with restarting position ids against ``flex_attention``
  with a document ``BlockMask``.

Times are ``triton.testing.do_bench`` medians of forward + backward (the gradients of q, k and v).
TFLOP/s counts a causal forward as 2·2·B·H·S²·D / 2 and the backward as 2.5× that (so forward +
backward is 3.5×); for documents the same count over each document's own causal square. The share of
the bf16 matmul ceiling is of the rate measured in the same run (an 8,192³ matmul, as chapter 00
measures it). Each peer's output and gradients are checked against ours before timing (bf16 relative
error). A peer that has no kernel for the case is recorded as missing, with why.

Results go to ``runs/attention/<gpu>.json`` (``--out`` picks another results root; an existing file
is replaced only with ``--force``); ``--record`` writes ``assets/results/attention/<gpu>.json``
instead, the file ``kernels.hf.attention.attention_choice`` reads to decide ``patch_llama``'s
default attention. In the interpreter the command runs tiny shapes and SDPA's math kernel only
(timings there mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import attention, runtime
from kernels.attention import flash_attention
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL

from . import cli
from .results import RESULTS, device_slug, first_line, results_file
from .timing import time_ms

GPU_SHAPE = dict(heads=32, kv_heads=8, head_dim=128, tokens=16384, seqs=(2048, 8192, 32768), doc=1024)
CPU_SHAPE = dict(heads=2, kv_heads=1, head_dim=32, tokens=128, seqs=(64, 128), doc=32)
BACKWARD_FACTOR = 2.5


def causal_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention as counted here: 2·2·B·H·S²·D/2 forward, 2.5×
    that backward.

    Args:
        batch: sequences.
        heads: query heads.
        seq: tokens per sequence.
        head_dim: the head's size.

    Returns:
        the FLOP count.
    """
    return 2 * 2 * batch * heads * seq * seq * head_dim / 2 * (1 + BACKWARD_FACTOR)


def inputs(batch, heads, kv_heads, seq, head_dim, dtype, seed=0):
    """q, k, v (requiring gradients) and an output gradient, drawn from ``seed`` on this device in
    ``dtype``.

    Args:
        batch: sequences.
        heads: query heads.
        kv_heads: key/value heads.
        seq: tokens per sequence.
        head_dim: the head's size.
        dtype: the tensors' dtype.
        seed: the seed.

    Returns:
        ``(q, k, v, grad)``, each [batch, heads (or kv_heads), seq, head_dim].
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = runtime.device()

    def draw(h):
        return torch.randn(batch, h, seq, head_dim, generator=g).to(dev, dtype).requires_grad_(True)

    q, k, v = draw(heads), draw(kv_heads), draw(kv_heads)
    return q, k, v, torch.randn(batch, heads, seq, head_dim, generator=g).to(dev, dtype)


def _sdpa(backend):
    """SDPA forced to one backend, K and V shared by the query heads (``enable_gqa``). A backend
    without a GQA kernel gets K and V repeated inside the timed call (the copy is part of what using
    it costs)."""
    from torch.nn.attention import sdpa_kernel

    def gqa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def repeated(q, k, v):
        group = q.shape[1] // k.shape[1]
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                                  v.repeat_interleave(group, 1),
                                                  is_causal=True)

    def run(q, k, v):
        if run.repeat:
            return repeated(q, k, v)
        try:
            return gqa(q, k, v)
        except RuntimeError:
            run.repeat = True
            return repeated(q, k, v)
    run.repeat = False
    return run


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(mask_mod_for: Callable):
    from torch.nn.attention.flex_attention import create_block_mask

    def make(batch, heads, seq):
        block_mask = create_block_mask(mask_mod_for(seq), None, None, seq, seq, device=runtime.device())
        return lambda q, k, v: _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)
    return make


def _causal(seq):
    return lambda b, h, qi, ki: qi >= ki


def _documents(doc):
    def mask_for(seq):
        return lambda b, h, qi, ki: (qi >= ki) & (qi // doc == ki // doc)
    return mask_for


def dense_peers() -> dict[str, Callable]:
    """Name → factory(batch, heads, seq) of a function (q, k, v) → out, for dense causal attention.

    Returns:
        the factories: ours and PyTorch's SDPA backends (with FlexAttention on a GPU).
    """
    if runtime.MODE != "gpu":
        from torch.nn.attention import SDPBackend

        return {"ours": lambda *s: lambda q, k, v: flash_attention(q, k, v, causal=True),
                "sdpa_math": lambda *s: _sdpa(SDPBackend.MATH)}
    from torch.nn.attention import SDPBackend

    # ours_pointers: the same kernels loading through pointers, not the TMA (version 5's loads)
    return {"ours": lambda *s: lambda q, k, v: flash_attention(q, k, v, causal=True),
            "ours_pointers": _ours(USE_TMA=False),
            "sdpa_flash": lambda *s: _sdpa(SDPBackend.FLASH_ATTENTION),
            "sdpa_cudnn": lambda *s: _sdpa(SDPBackend.CUDNN_ATTENTION),
            "flex": _flex(_causal)}


@contextlib.contextmanager
def _setting(name: str, value: bool):
    # One of kernels.attention's switches (PACKED_INTERIOR, USE_TMA, PACKED_TMA) set for the timed call
    # only.
    saved = getattr(attention, name)
    setattr(attention, name, value)
    try:
        yield
    finally:
        setattr(attention, name, saved)


def _ours(**settings) -> Callable:
    # A factory of ours under the given switches; position ids when "doc" is given.
    doc = settings.pop("doc", None)

    def make(batch, heads, seq):
        positions = document_positions(batch, seq, doc) if doc else None

        def call(q, k, v):
            with contextlib.ExitStack() as stack:
                for name, value in settings.items():
                    stack.enter_context(_setting(name, value))
                return flash_attention(q, k, v, causal=True, position_ids=positions)
        return call
    return make


def document_positions(batch: int, seq: int, doc: int, device=None) -> torch.Tensor:
    """Position ids [batch, seq] of rows packed with documents of ``doc`` tokens: 0, 1, ..., doc −
    1, 0, 1, ...

    Args:
        batch: rows.
        seq: tokens per row.
        doc: tokens per document.
        device: where the tensor lives (None: this machine's device).

    Returns:
        the position ids, an expanded view.
    """
    return (torch.arange(seq, device=device or runtime.device()) % doc)[None].expand(batch, seq)


def document_peers(doc: int) -> dict[str, Callable]:
    """Name → factory for causal attention within documents of ``doc`` tokens.

    Args:
        doc: tokens per document.

    Returns:
        the factories: ours packed and masked (with FlexAttention's document mask on a GPU).
    """
    # ours_packed with the package's settings; ours_masked with every block of a packed row masked,
    # the walk of version 2; ours_packed_tma loading its tiles through the TMA
    peers = {"ours_packed": _ours(doc=doc), "ours_masked": _ours(doc=doc, PACKED_INTERIOR=False)}
    if runtime.MODE == "gpu":
        peers["ours_packed_tma"] = _ours(doc=doc, PACKED_TMA=True)
        peers["flex_documents"] = _flex(_documents(doc))
    return peers


def _fwd_bwd(fn, q, k, v, grad):
    out = fn(q, k, v)
    out.backward(grad)
    return out


def _check(fn, reference, q, k, v, grad) -> float:
    """The worst relative error of fn's output and gradients against ``reference`` (ours): both on
    one input."""
    results = []
    for f in (fn, reference):
        for t in (q, k, v):
            t.grad = None
        out = _fwd_bwd(f, q, k, v, grad)
        results.append([out.detach()] + [t.grad.detach().clone() for t in (q, k, v)])
    for t in (q, k, v):
        t.grad = None
    return max(relative_error(a, b, on_device=True) for a, b in zip(*results))


def measure(peers: dict[str, Callable], batch, heads, kv_heads, seq, head_dim, flops, matmul_tflops) -> dict:
    """One row: each peer's checked forward + backward time, TFLOP/s and share of the matmul ceiling.

    Args:
        peers: name -> factory(batch, heads, seq).
        batch: sequences.
        heads: query heads.
        kv_heads: key/value heads.
        seq: tokens per sequence.
        head_dim: the head's size.
        flops: the FLOP count of one forward + backward.
        matmul_tflops: the GPU's matmul ceiling (None: no share).

    Returns:
        the row: times, TFLOP/s, shares and errors per peer, and ``missing`` with why.
    """
    q, k, v, grad = inputs(batch, heads, kv_heads, seq, head_dim, torch.bfloat16 if runtime.MODE == "gpu"
                            else torch.float32)
    row = {"seq": seq, "batch": batch, "ms": {}, "tflops": {}, "of_matmul": {}, "error": {}, "missing": {}}
    fns = {}
    for name, factory in peers.items():
        try:
            fns[name] = factory(batch, heads, seq)
        except Exception as exc:  # noqa: BLE001  (a peer without a kernel for this case is recorded, not fatal)
            row["missing"][name] = first_line(exc)
    reference = next(iter(fns.values()))
    tol = RELATIVE_ERROR_TOL[q.dtype] * 2  # two bf16 implementations, each within the bound of float64
    for name, fn in fns.items():
        try:
            err = _check(fn, reference, q, k, v, grad) if fn is not reference else 0.0
            if not err < tol:
                row["missing"][name] = f"disagrees with ours: relative error {err:.2e}"
                continue
            ms = time_ms(lambda fn=fn: _fwd_bwd(fn, q, k, v, grad), grad_to_none=[q, k, v])
        except Exception as exc:  # noqa: BLE001
            row["missing"][name] = first_line(exc)
            continue
        row["ms"][name], row["error"][name] = ms, err
        if getattr(fn, "repeat", False):
            row.setdefault("notes", {})[name] = "no GQA kernel: K and V repeated inside the timed call"
        row["tflops"][name] = flops / (ms * 1e-3) / 1e12
        row["of_matmul"][name] = row["tflops"][name] / matmul_tflops if matmul_tflops else None
    return row


def _matmul_tflops() -> float | None:
    if runtime.MODE != "gpu":
        return None
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(functools.partial(torch.matmul, a, b), warmup=50, rep=200)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def run(seqs=None, tokens: int | None = None) -> dict:
    """Time ours and the peers, dense and over packed documents, at each length (chapter 16 shows it).

    Args:
        seqs: the sequence lengths (None: the mode's).
        tokens: tokens per batch (None: the mode's).

    Returns:
        device, versions, settings, the dense rows and the documents' rows.
    """
    shape = GPU_SHAPE if runtime.MODE == "gpu" else CPU_SHAPE
    seqs = tuple(seqs or shape["seqs"])
    heads, kv_heads, d, doc = (shape[k] for k in ("heads", "kv_heads", "head_dim", "doc"))
    tokens = tokens or shape["tokens"]
    matmul = _matmul_tflops()
    result = {"device": runtime.device_name(), "device_slug": device_slug(), "mode": runtime.MODE,
              "versions": runtime.versions(), "kernel_version": attention.VERSION, "matmul_tflops": matmul,
              "settings": dict(heads=heads, kv_heads=kv_heads, head_dim=d, tokens_per_batch=tokens,
                               seqs=list(seqs),
                               document_tokens=doc, dtype="bfloat16" if runtime.MODE == "gpu" else "float32",
                               causal=True, backward_factor=BACKWARD_FACTOR),
              "rows": [], "documents": []}
    for seq in seqs:
        batch = max(1, tokens // seq)
        result["rows"].append(measure(dense_peers(), batch, heads, kv_heads, seq, d,
                                      causal_flops(batch, heads, seq, d), matmul))
        docs_flops = causal_flops(batch * max(1, seq // doc), heads, min(doc, seq), d)
        result["documents"].append(measure(document_peers(doc), batch, heads, kv_heads, seq, d,
                                           docs_flops, matmul))
        if runtime.MODE == "gpu":
            torch.cuda.empty_cache()  # the next length's inputs have other shapes
    return result


def ratios(result: dict) -> list[dict]:
    """Ours against each peer per length (peer time / our time: above 1 means ours is faster).

    Args:
        result: the dict of ``run``.

    Returns:
        one entry per length: ``vs_<peer>`` and the documents' ratios.
    """
    out = []
    for row, docs in zip(result["rows"], result["documents"]):
        ms, dms = row["ms"], docs["ms"]
        entry = {"seq": row["seq"]}
        for peer in ("ours_pointers", "sdpa_flash", "sdpa_cudnn", "flex", "sdpa_math"):
            if peer in ms and "ours" in ms:
                entry[f"vs_{peer}"] = ms[peer] / ms["ours"]
        if "flex_documents" in dms and "ours_packed" in dms:
            entry["packed_vs_flex_documents"] = dms["flex_documents"] / dms["ours_packed"]
        if "ours_packed_tma" in dms and "ours_packed" in dms:
            entry["packed_vs_packed_tma"] = dms["ours_packed_tma"] / dms["ours_packed"]
        if "flex_documents" in dms and "ours_masked" in dms:
            entry["masked_vs_flex_documents"] = dms["flex_documents"] / dms["ours_masked"]
        out.append(entry)
    return out


def format_table(result: dict) -> str:
    """The result as text: each peer's time per length, what is missing, the ratios (chapter 16).

    Args:
        result: the dict of ``run`` (or ``load``).

    Returns:
        the table, lines joined by newlines.
    """
    matmul = result.get("matmul_tflops")
    st = result["settings"]
    lines = [f"{result['device']}: attention forward + backward, {st['heads']}/{st['kv_heads']} heads, "
             f"d={st['head_dim']}, {st['tokens_per_batch']:,} tokens per batch, causal"
             + (f"; bf16 matmul ceiling {matmul:.0f} TFLOP/s" if matmul else "")]
    for row in result["rows"] + result["documents"]:
        kind = "documents" if "ours_packed" in row["ms"] or "flex_documents" in row["ms"] else "dense"
        for name, ms in row["ms"].items():
            share = f" {row['of_matmul'][name]:6.1%} of matmul" if row["of_matmul"].get(name) else ""
            lines.append(f"  seq {row['seq']:>7,} {kind:<9} {name:<20}{ms:10.2f} ms {row['tflops'][name]:7.1f} "
                         f"TFLOP/s{share}")
        for name, why in row["missing"].items():
            lines.append(f"  seq {row['seq']:>7,} {kind:<9} {name:<20} missing: {why}")
    for entry in ratios(result):
        parts = ", ".join(f"{k} {v:.2f}×" for k, v in entry.items() if k != "seq")
        lines.append(f"  seq {entry['seq']:>7,}: ours against peers (their time / ours): {parts}")
    lines.append(version_note(result))
    return "\n".join(lines)


def version_note(result: dict) -> str:
    """Which version of our kernels the run timed, and whether it is the package's (runs before the
    field: 1).

    Args:
        result: the dict of ``run``.

    Returns:
        the note, one line.
    """
    timed = result.get("kernel_version", 1)
    if timed == attention.VERSION:
        return f"  ours: kernel version {timed}, the package's"
    return (f"  ours: kernel version {timed}; the package's is version {attention.VERSION}, not timed in this run "
            "(assets/notes/attention.md says what changed)")


def load(path: Path | None = None) -> dict | None:
    """The recorded run of this GPU (else the first recorded one), or None when there is none yet.

    Chapter 16 reads it.

    Args:
        path: a results file (None: this GPU's, else the first one recorded).

    Returns:
        the result's dict, or None.
    """
    folder = RESULTS / "attention"
    if path is None:
        candidates = [folder / f"{device_slug()}.json", *sorted(folder.glob("*.json"))]
        path = next((p for p in candidates if p.exists()), None)
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m kernels.bench.attention``.

    Returns:
        the parser.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=cli.positive_int, nargs="+", default=None,
                        help="sequence lengths (default 2048 8192 32768 on a GPU; 131072 is optional)")
    parser.add_argument("--tokens", type=cli.positive_int, default=None,
                        help="tokens per batch (default 16384 on a GPU); batch = tokens / seq, at least 1")
    cli.add_output_arguments(parser,
                             "attention/<gpu>.json (with --record, the file patch_llama's default reads)")
    return parser


def main(argv=None) -> int:
    """Time attention from the command line, print the table, write ``attention/<gpu>.json``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    root = cli.output_root(args)
    path = results_file("attention", device_slug(), root)
    problems = []
    if root.resolve() == RESULTS.resolve() and not args.record:
        problems.append("writing into assets/results needs --record (the committed results are not replaced by "
                        "default)")
    cli.check_outputs(parser, args, [path], problems)
    print(runtime.describe())
    result = run(args.seqs, args.tokens)
    print(format_table(result))
    print("saved", cli.write_json(path, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

