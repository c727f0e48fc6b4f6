"""The LoRA step, side by side in one run: the floor, Hugging Face + PEFT, patched + PEFT, Liger + PEFT.

``python -m kernels.bench.lora`` builds one Llama (random weights, bf16 base, eager SDPA) and times,
one after the other on the same model and the same batches:

* **floor, Hugging Face**: the frozen model without adapters; the backward still runs through every
  layer (input gradients only, as a LoRA step's does), no optimizer;
* **floor, patched**: the same with ``patch_llama``'s default kernels: the floor the fused LoRA step
  is held to;
* **Hugging Face + PEFT**: LoRA (r=16, α=32, dropout 0) on q, k, v, o, gate, up, down; torch's fused
  AdamW on the adapters;
* **patched + PEFT, lora off**: ``patch_llama``'s other defaults, PEFT's own LoRA layers;
* **patched + PEFT**: the defaults with the ``lora`` switch: q/k/v and gate/up one node per group on
  their shared input (``kernels.lora.lora_group``), o_proj and down_proj one fused node each, the
  low-rank product written first and the base GEMM adding onto it in its β-epilogue
  (``epilogue="cublas_lowrank_first"``; the same for dx);
* **patched first, then PEFT**: the other order, as TRL's ``SFTTrainer(peft_config=...)`` runs it:
  ``patch_llama`` on the bare model, then ``get_peft_model``; the layers PEFT injects are fused at the
  first forward (the adapters start from the same values as the other PEFT setups);
* **patched + PEFT, one node per layer**: the same with every LoRA layer its own node
  (``SHARED_INPUT = False``);
* **patched + PEFT, low-rank product after**: one node per layer, the base GEMM first and the
  low-rank product added onto its output (``epilogue="cublas"``);
* **patched + PEFT, adapter merged where cheaper** (``epilogue="auto"``): W + s·B·A as a temporary
  weight for each GEMM whose reduced dimension is below the tokens, the β-epilogue elsewhere;
* **patched + PEFT, Triton epilogue and split-K**: the same with the Triton GEMM epilogue and the
  split-K dA/dB;
* **Liger + PEFT**: Liger's RoPE, SwiGLU, RMSNorm and fused linear cross-entropy, if
  ``liger_kernel`` imports.

Each setup: tokens/s over timed steps after warm-up steps, the step's peak memory
(``max_memory_allocated``), and the loss of its first step (the same batch for all: the patched
setups must give PEFT's loss). Then the per-layer micro-benchmarks at the preset's shapes
(``micro``): the forward of one adapted layer PEFT's way, with cuBLAS's β-epilogue and with the
Triton epilogue, against the bare base GEMM; cuBLAS against the Triton GEMM with no epilogue; and
cuBLAS against split-K for dA and dB.

Results go to ``runs/lora/<name>.json`` (``--out`` picks another results root; an existing file is
replaced only with ``--force``); ``--record`` writes ``assets/results/lora/<name>.json``, the files
chapter 15 reads.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.gemm import gemm_epilogue, splitk_mm
from kernels.hf import lora as hf_lora
from kernels.hf.patch import patch_llama
from kernels.hf.presets import PRESETS, llama_config
from kernels.lora import lora_forward, skinny_mm

from . import cli
from .results import RESULTS, device_slug, first_line, results_file
from .timing import time_ms

GROUP = "lora"
GIB = 2**30
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETUPS = ("floor_hf", "floor_patched", "hf_peft", "patched_peft_lora_off", "patched_peft",
          "patch_then_peft", "patched_peft_one_by_one",
          "patched_peft_lowrank_after", "patched_peft_auto", "patched_peft_triton", "liger_peft")
LABELS = {
    "floor_hf": "floor: frozen model, no adapters (Hugging Face)",
    "floor_patched": "floor: frozen model, no adapters (patch_llama defaults)",
    "hf_peft": "Hugging Face + PEFT",
    "patched_peft_lora_off": "patch_llama (lora=False) + PEFT",
    "patched_peft": "patch_llama (defaults, lora on) + PEFT",
    "patch_then_peft": "patch_llama first, then PEFT (defaults)",
    "patched_peft_one_by_one": "patch_llama + PEFT, one node per layer",
    "patched_peft_lowrank_after": "patch_llama + PEFT, one node per layer, low-rank after",
    "patched_peft_auto": "patch_llama + PEFT, adapter merged where cheaper",
    "patched_peft_triton": "patch_llama + PEFT, Triton epilogue + split-K",
    "liger_peft": "Liger (RoPE, SwiGLU, RMSNorm, FLCE) + PEFT",
}


# --------------------------------------------------------------------------------------------------
# The model, the batches, one step
# --------------------------------------------------------------------------------------------------


def build_llama(preset: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                **overrides) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``preset`` built on ``device`` in ``dtype`` (random weights, SDPA,
    no cache).

    Args:
        preset: a name of ``kernels.hf.presets.PRESETS``.
        dtype: the weights' dtype.
        device: where the weights are made.
        seed: the random weights' seed.
        **overrides: ``LlamaConfig`` settings that replace the preset's (``num_hidden_layers=4``).

    Returns:
        The model, in training mode.
    """
    from transformers import LlamaForCausalLM

    config = llama_config(preset, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.config.use_cache = False
    return model.train()


def make_batches(vocab: int, batch: int, seq: int, count: int, device, seed: int = 0) -> list[dict]:
    """``count`` random SFT batches: the first quarter of each row is prompt (labels -100).

    Args:
        vocab: token ids are drawn below it.
        batch, seq: rows per batch and tokens per row.
        count: how many batches.
        device: where the batches go.
        seed: the draw's seed.

    Returns:
        A list of ``{"input_ids", "labels"}`` dicts.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        labels = ids.clone()
        labels[:, : seq // 4] = -100
        out.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return out


def lora_config(rank: int, alpha: float, use_rslora: bool = False):
    """PEFT's ``LoraConfig`` of every setup: dropout 0 on the seven projections of ``TARGETS``.

    Args:
        rank, alpha: the adapters' rank and scaling numerator.
        use_rslora: scale by α/√r instead of α/r.

    Returns:
        A ``peft.LoraConfig`` for a causal LM.
    """
    import peft

    return peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(TARGETS),
                           use_rslora=use_rslora, task_type="CAUSAL_LM")


def restore_adapters(net, initial: dict) -> list[torch.nn.Parameter]:
    """Put every trained parameter of ``net`` back to its starting value, so that each setup of a
    comparison starts from the same adapters.

    Args:
        net: the model.
        initial: each trained parameter's starting value, keyed by the parameter.

    Returns:
        the trained parameters, in ``net.parameters()``' order.
    """
    trained = [p for p in net.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in trained:
            p.copy_(initial[p])
    return trained


def time_steps(model, batches: list[dict], warmup: int, steps: int, optimizer=None) -> dict:
    """Run ``warmup`` then ``steps`` training steps; tokens/s of the timed ones, the peak, the first loss.

    Args:
        model: the model to train (its loss from ``labels``).
        batches: the batches, taken in turn.
        warmup, steps: untimed, then timed steps.
        optimizer: stepped and zeroed after each backward, if given (the floor has none).

    Returns:
        ``tokens_per_s``, ``step_ms``, ``peak_gib`` (None off the GPU) and ``first_loss``.
    """
    device = batches[0]["input_ids"].device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    first_loss, elapsed, tokens = None, 0.0, 0
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        runtime.synchronize(device)
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        runtime.synchronize(device)
        if i == 0:
            first_loss = float(loss)
        if i >= warmup:
            elapsed += time.perf_counter() - start
            tokens += batch["input_ids"].numel()
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return {"tokens_per_s": tokens / elapsed, "step_ms": 1e3 * elapsed / steps, "peak_gib": peak,
            "first_loss": first_loss}


# --------------------------------------------------------------------------------------------------
# The setups
# --------------------------------------------------------------------------------------------------


def _liger_patch(model):
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)


@contextlib.contextmanager
def _lora_backends(epilogue: str, skinny: str, shared_input: bool = False):
    saved = hf_lora.EPILOGUE, hf_lora.SKINNY, hf_lora.SHARED_INPUT
    hf_lora.EPILOGUE, hf_lora.SKINNY, hf_lora.SHARED_INPUT = epilogue, skinny, shared_input
    try:
        yield
    finally:
        hf_lora.EPILOGUE, hf_lora.SKINNY, hf_lora.SHARED_INPUT = saved


def run_setups(preset: str, batch: int, seq: int, rank: int, alpha: float, warmup: int, steps: int,
               checkpointing: bool, setups=SETUPS, seed: int = 0, log=print) -> dict:
    """Every setup of ``setups`` on one model, in a fixed order (Liger last: it patches modules for
    the process).

    Args:
        preset, batch, seq: the model and the step's shape.
        rank, alpha: the adapters'.
        warmup, steps: untimed, then timed steps per setup.
        checkpointing: gradient checkpointing on every decoder layer.
        setups: the names of ``SETUPS`` to run.
        seed: the weights', batches' and adapters' seed.
        log: where progress lines go.

    Returns:
        ``rows`` (one per setup run: its timings, or the error that stopped it),
        ``trainable_parameters``, and the summaries of the fused LoRA layers (``lora_layers``, and
        ``lora_layers_patch_first`` for the patch-first order).
    """
    import peft

    device = runtime.device()
    dtype = torch.bfloat16 if runtime.MODE == "gpu" else torch.float32
    model = build_llama(preset, dtype, device, seed)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.requires_grad_(False)
    model.enable_input_require_grads()  # the frozen floor still runs the backward through every layer
    batches = make_batches(model.config.vocab_size, batch, seq, 2, device, seed)
    rows = {}

    initial = {}  # the adapters as PEFT made them: every PEFT setup starts from them, with a fresh optimizer

    def measure(name, net, adapters=False):
        if name not in setups:
            return
        log(f"  {LABELS[name]} …", flush=True)
        optimizer = None
        if adapters:
            trained = restore_adapters(net, initial)
            optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")
        try:
            rows[name] = time_steps(net, batches, warmup, steps, optimizer)
        except torch.OutOfMemoryError as err:
            rows[name] = {"error": f"out of memory: {first_line(err)}"}
        rows[name]["label"] = LABELS[name]
        log(f"    {_row_text(rows[name])}", flush=True)

    measure("floor_hf", model)
    with patch_llama(model):
        measure("floor_patched", model)
    wrapped = peft.get_peft_model(model, lora_config(rank, alpha))
    initial.update({p: p.detach().clone() for p in wrapped.parameters() if p.requires_grad})
    measure("hf_peft", wrapped, adapters=True)
    with patch_llama(wrapped, lora=False):
        measure("patched_peft_lora_off", wrapped, adapters=True)
    with patch_llama(wrapped, lora=True) as patch:
        rows_lora = patch.lora.summary() if patch.lora is not None else ""
        measure("patched_peft", wrapped, adapters=True)
        with _lora_backends("cublas_lowrank_first", "cublas"):
            measure("patched_peft_one_by_one", wrapped, adapters=True)
        with _lora_backends("cublas", "cublas"):
            measure("patched_peft_lowrank_after", wrapped, adapters=True)
        with _lora_backends("auto", "cublas"):
            measure("patched_peft_auto", wrapped, adapters=True)
        with _lora_backends("triton", "splitk"):
            measure("patched_peft_triton", wrapped, adapters=True)
    if "patch_then_peft" in setups:
        wrapped, rows_patch_first = _patch_then_wrap(wrapped, lambda base: peft.get_peft_model(
            base, lora_config(rank, alpha)), initial, measure)
    if "liger_peft" in setups:
        try:
            _liger_patch(wrapped.get_base_model())
        except ImportError as err:
            rows["liger_peft"] = {"label": LABELS["liger_peft"],
                                  "error": f"liger_kernel not importable: {err}"}
        else:
            measure("liger_peft", wrapped, adapters=True)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    initial.clear()
    del wrapped, model
    gc.collect()
    out = {"rows": rows, "trainable_parameters": trainable, "lora_layers": rows_lora}
    if "patch_then_peft" in setups:
        out["lora_layers_patch_first"] = rows_patch_first
    return out


def _patch_then_wrap(wrapped, wrap, initial: dict, measure):
    """The other order, as TRL's ``SFTTrainer(peft_config=...)`` runs it: PEFT's layers taken out of
    ``wrapped``, ``patch_llama`` on the bare model, then PEFT wrapped again; the adapters start from
    the values the first wrap gave them (matched by name). Returns the new PEFT model (unpatched
    again when this returns) and the fused layers' summary."""
    by_name = {name: initial[p] for name, p in wrapped.named_parameters() if p.requires_grad}
    base = wrapped.unload()
    with patch_llama(base) as patch:
        rewrapped = wrap(base)
        initial.update({p: by_name[name] for name, p in rewrapped.named_parameters() if p.requires_grad})
        measure("patch_then_peft", rewrapped, adapters=True)
        summary = patch.lora.summary() if patch.lora is not None else ""
    return rewrapped, summary


# --------------------------------------------------------------------------------------------------
# Per-layer micro-benchmarks
# --------------------------------------------------------------------------------------------------


def layer_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted projection of ``preset``.

    Args:
        preset: a name of ``PRESETS``.

    Returns:
        ``{projection name: (in features, out features)}``.
    """
    c = llama_config(preset)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    return {"q_proj": (c.hidden_size, c.num_attention_heads * head_dim), "k_proj": (c.hidden_size, kv),
            "v_proj": (c.hidden_size, kv), "o_proj": (c.num_attention_heads * head_dim, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}


def _peft_forward(x, w, a32, b32, scale):
    # What PEFT computes: the base layer, x cast to the adapters' float32, their two linears, the
    # scaling, the add.
    result = F.linear(x, w)
    xf = x.to(a32.dtype)
    return (result + F.linear(F.linear(xf, a32), b32) * scale).to(x.dtype)


def _micro_row(name: str, n_in: int, n_out: int, tokens: int, rank: int, scale: float, gen, device,
               dtype) -> dict:
    x = torch.randn(tokens, n_in, generator=gen).to(device, dtype)
    w = (torch.randn(n_out, n_in, generator=gen) / n_in**0.5).to(device, dtype)
    a = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).to(device)
    b = torch.randn(n_out, rank, generator=gen).to(device)
    dy = torch.randn(tokens, n_out, generator=gen).to(device, dtype)
    xa = x @ a.to(dtype).t()
    dxa = (dy @ b.to(dtype)) * scale
    wt = w.t()
    return {
        "layer": name, "tokens": tokens, "in": n_in, "out": n_out, "rank": rank,
        "base_gemm_cublas_ms": time_ms(lambda: F.linear(x, w)),
        "base_gemm_triton_ms": time_ms(lambda: gemm_epilogue(x, wt)),
        "fwd_peft_ms": time_ms(lambda: _peft_forward(x, w, a, b, scale)),
        "fwd_cublas_epilogue_ms": time_ms(lambda: lora_forward(x, w, None, a, b, scale, "cublas")),
        "fwd_cublas_lowrank_first_ms": time_ms(lambda: lora_forward(x, w, None, a, b, scale,
                                                                    "cublas_lowrank_first")),
        "fwd_merged_ms": time_ms(lambda: lora_forward(x, w, None, a, b, scale, "merged")),
        "fwd_triton_epilogue_ms": time_ms(lambda: lora_forward(x, w, None, a, b, scale, "triton")),
        "dA_cublas_ms": time_ms(lambda: skinny_mm(dxa, x, 1.0, torch.float32, "cublas")),
        "dA_splitk_ms": time_ms(lambda: splitk_mm(dxa, x, 1.0, torch.float32)),
        "dB_cublas_ms": time_ms(lambda: skinny_mm(dy, xa, scale, torch.float32, "cublas")),
        "dB_splitk_ms": time_ms(lambda: splitk_mm(dy, xa, scale, torch.float32)),
    }


def micro(preset: str, tokens: int, rank: int, alpha: float,
          names=("q_proj", "k_proj", "gate_proj", "down_proj"),
          seed: int = 0) -> list[dict]:
    """Per adapted layer (ms, median): forward PEFT's way, with the cuBLAS β-epilogue (the low-rank
    product added after the base GEMM, and written before it), merged into a temporary weight, with
    the Triton epilogue, and the bare base GEMM; the GEMM alone in cuBLAS and in Triton; dA and dB
    by cuBLAS and by split-K.

    Args:
        preset: whose layer shapes.
        tokens: rows of x.
        rank, alpha: the adapter's.
        names: the projections timed.
        seed: the inputs' seed.

    Returns:
        One dict per layer: its shape and each timing (``…_ms``).
    """
    device = runtime.device()
    dtype = torch.bfloat16 if runtime.MODE == "gpu" else torch.float32
    gen = torch.Generator().manual_seed(seed)
    shapes = layer_shapes(preset)
    return [_micro_row(name, *shapes[name], tokens, rank, alpha / rank, gen, device,
                       dtype) for name in names]


# --------------------------------------------------------------------------------------------------
# Targets, text, the command line
# --------------------------------------------------------------------------------------------------


def verdicts(rows: dict) -> dict:
    """The targets, where the rows needed are there: patched against its floor (≥ 0.90), against Hugging Face
    + PEFT (≥ 1.40), peak within the floor's + 8 GiB, ahead of Liger + PEFT; patched first then wrapped
    within 3% of wrapped first then patched, in tokens/s and in peak.

    Args:
        rows: ``run_setups``'s rows.

    Returns:
        ``{target name: {"ratio" or "value", "target", "met"}}`` for the targets whose rows ran.
    """
    def tps(name):
        return rows.get(name, {}).get("tokens_per_s")

    out = {}
    ours, floor, hf, liger = tps("patched_peft"), tps("floor_patched"), tps("hf_peft"), tps("liger_peft")
    if ours and floor:
        out["vs_floor_patched"] = {"ratio": ours / floor, "target": 0.90, "met": ours / floor >= 0.90}
    if ours and hf:
        out["vs_hf_peft"] = {"ratio": ours / hf, "target": 1.40, "met": ours / hf >= 1.40}
    if ours and liger:
        out["vs_liger_peft"] = {"ratio": ours / liger, "target": 1.0, "met": ours > liger}
    first = tps("patch_then_peft")
    if ours and first:
        out["patch_first_vs_wrap_first"] = {"ratio": first / ours, "target": 0.97,
                                            "met": first / ours >= 0.97}
    first_peak = rows.get("patch_then_peft", {}).get("peak_gib")
    peak, floor_peak = rows.get("patched_peft", {}).get("peak_gib"), rows.get("floor_patched",
                                                                              {}).get("peak_gib")
    if peak is not None and first_peak is not None:
        out["patch_first_peak_vs_wrap_first"] = {"ratio": first_peak / peak, "target": 1.03,
                                                 "met": first_peak / peak <= 1.03}
    if peak is not None and floor_peak is not None:
        out["peak_over_floor_gib"] = {"value": peak - floor_peak, "target": 8.0,
                                      "met": peak - floor_peak <= 8.0}
    return out


def _row_text(row: dict) -> str:
    if "error" in row:
        return row["error"]
    peak = f"{row['peak_gib']:6.1f} GiB" if row.get("peak_gib") is not None else "   — GiB"
    return (f"{row['tokens_per_s']:10,.0f} tokens/s  {row['step_ms']:9.1f} ms/step  peak {peak}  "
            f"loss {row['first_loss']:.4f}")


def format_table(result: dict) -> str:
    """The run as text: one line per setup, the targets, the micro-benchmarks.

    Args:
        result: what ``run`` returns (or a recorded file's contents).

    Returns:
        The lines joined.
    """
    lines = [f"LoRA step, {result['settings']['preset']}, batch {result['settings']['batch']} × "
             f"{result['settings']['seq']}, r={result['settings']['rank']}, α={result['settings']['alpha']}"
             f"{', checkpointing' if result['settings']['checkpointing'] else ''} on {result['device']}"]
    timed = result.get("mode", "gpu") == "gpu"
    hf = result["rows"].get("hf_peft", {}).get("tokens_per_s") if timed else None
    for name in SETUPS:
        row = result["rows"].get(name)
        if row is None:
            continue
        ratio = f"  {row['tokens_per_s'] / hf:5.3f}× HF+PEFT" if hf and "tokens_per_s" in row else ""
        lines.append(f"  {row['label']:<52}{_row_text(row)}{ratio}")
    for key, v in result["targets"].items():
        value = v.get("ratio", v.get("value"))
        lines.append(f"  target {key}: {value:.3f} (target {v['target']}) {'met' if v['met'] else 'NOT met'}")
    if not timed:
        lines.append("  tokens/s and ms: wall-clock of Triton's CPU interpreter, meaningless as GPU time (no ratios; "
                     "targets not judged)")
    for row in result.get("micro", []):
        ms = {k: f"{v:.3f}" for k, v in row.items() if k.endswith("_ms")}
        # Columns added later are not in the runs recorded before them.
        first, merged = ms.get("fwd_cublas_lowrank_first_ms"), ms.get("fwd_merged_ms")
        lines.append(
            f"  {row['layer']:<9} fwd: PEFT {ms['fwd_peft_ms']}, cuBLAS epilogue {ms['fwd_cublas_epilogue_ms']}, "
            + (f"low-rank first {first}, " if first else "") + (f"merged {merged}, " if merged else "")
            + f"Triton epilogue {ms['fwd_triton_epilogue_ms']}, base GEMM {ms['base_gemm_cublas_ms']} (Triton GEMM "
            f"{ms['base_gemm_triton_ms']}) ms; dA cuBLAS {ms['dA_cublas_ms']} / split-K {ms['dA_splitk_ms']}; "
            f"dB cuBLAS {ms['dB_cublas_ms']} / split-K {ms['dB_splitk_ms']} ms")
    return "\n".join(lines)


def load_recorded(name: str = "llama-3.1-8b_b4", directory: Path = RESULTS) -> dict | None:
    """A committed run (``assets/results/lora/<name>.json``, written with ``--record``), or None if
    there is none. Chapter 15 shows it.

    Args:
        name: the file's name without ``.json``.
        directory: the results root.

    Returns:
        The run's dict, or None.
    """
    path = results_file(GROUP, name, directory)
    return json.loads(path.read_text()) if path.exists() else None


def default_name(preset: str, batch: int, checkpointing: bool) -> str:
    """The result file's default name, ``<preset>_b<batch>[_ckpt]``.

    Args:
        preset, batch, checkpointing: the run's settings.

    Returns:
        The name.
    """
    return f"{preset}_b{batch}{'_ckpt' if checkpointing else ''}"


def run(preset: str, batch: int, seq: int, rank: int, alpha: float, warmup: int, steps: int,
        checkpointing: bool,
        setups=SETUPS, with_micro: bool = True, log=print) -> dict:
    """One whole run: the setups (``run_setups``), the targets judged on a GPU, then the micro-benchmarks.

    Args:
        preset, batch, seq, rank, alpha, warmup, steps, checkpointing, setups, log: as for
            ``run_setups``.
        with_micro: run the per-layer micro-benchmarks too.

    Returns:
        The result dict that ``--record`` writes: settings, device, rows, targets, micro rows.
    """
    log(runtime.describe())
    settings = dict(preset=preset, batch=batch, seq=seq, rank=rank, alpha=alpha, dropout=0.0,
                    targets=list(TARGETS),
                    warmup=warmup, steps=steps, checkpointing=checkpointing,
                    optimizer="torch AdamW (fused on GPU)",
                    base_dtype="bfloat16" if runtime.MODE == "gpu" else "float32", attention="sdpa")
    step = run_setups(preset, batch, seq, rank, alpha, warmup, steps, checkpointing, setups, log=log)
    result = {"group": GROUP, "device": runtime.device_name(), "device_slug": device_slug(),
              "mode": runtime.MODE,
              "settings": settings, **step,
              # The interpreter's wall-clock says nothing of GPU speed: no target is judged on it.
              "targets": verdicts(step["rows"]) if runtime.MODE == "gpu" else {}}
    if with_micro:
        log("  per-layer micro-benchmarks …", flush=True)
        result["micro"] = micro(preset, batch * seq, rank, alpha)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser.

    Returns:
        The ``argparse`` parser of ``python -m kernels.bench.lora``.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.lora",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, choices=tuple(PRESETS),
                        help="llama-3.1-8b (GPU default), llama-3.2-1b, tiny (CPU default)")
    parser.add_argument("--batch", type=cli.positive_int, default=None,
                        help="rows per step (default 4; CPU 1)")
    parser.add_argument("--seq", type=cli.positive_int, default=None,
                        help="tokens per row (default 2048; CPU 37)")
    parser.add_argument("--rank", type=cli.positive_int, default=16)
    parser.add_argument("--alpha", type=cli.positive_float, default=32.0)
    parser.add_argument("--warmup", type=cli.non_negative_int, default=None,
                        help="untimed steps first (default 2; CPU 0)")
    parser.add_argument("--steps", type=cli.positive_int, default=None,
                        help="timed steps per setup (default 5; CPU 1)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on every layer")
    parser.add_argument("--setups", type=cli.names(SETUPS), default=SETUPS,
                        help=f"comma-separated subset of {','.join(SETUPS)}")
    parser.add_argument("--no-micro", action="store_true", help="skip the per-layer micro-benchmarks")
    parser.add_argument("--name", type=cli.file_name, default=None,
                        help="file name (default <preset>_b<batch>[_ckpt])")
    cli.add_output_arguments(parser, f"{GROUP}/<name>.json")
    return parser


def main(argv=None) -> int:
    """``python -m kernels.bench.lora``: run, print the tables, save the file.

    Args:
        argv: the arguments (``sys.argv[1:]`` when None).

    Returns:
        0; arguments it refuses end the process with status 2 before any work (argparse's error).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    setups = args.setups
    preset = args.preset or runtime.pick("tiny", "llama-3.1-8b")
    batch, seq = args.batch or runtime.pick(1, 4), args.seq or runtime.pick(37, 2048)
    warmup = args.warmup if args.warmup is not None else runtime.pick(0, 2)
    steps = args.steps or runtime.pick(1, 5)
    name = args.name or default_name(preset, batch, args.checkpointing)
    path = results_file(GROUP, name, cli.output_root(args))
    cli.check_outputs(parser, args, [path])
    result = run(preset, batch, seq, args.rank, args.alpha, warmup, steps, args.checkpointing, setups,
                 with_micro=not args.no_micro)
    print(format_table(result))
    print("saved", cli.write_json(path, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
