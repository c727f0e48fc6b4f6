"""LoRA over an FP8 base, measured: the step beside the bf16 ones, the accuracy over a training run, a 70B step.

``python -m kernels.bench.lora_fp8 --mode step`` builds one Llama (random weights, bf16, the 8B
shape on a GPU), wraps it with PEFT (r=16, α=32, the seven projections) and times, one after the
other on the same batches (``kernels.bench.lora``'s steps: tokens/s, peak, first loss):

* **Hugging Face + PEFT** (bf16 base);
* **patch_llama + PEFT**: the fused bf16 LoRA step of chapter 15;
* **patch_llama(fp8_base=True) + PEFT**: the frozen base converted to FP8 (one-way, so these rows
  come last), the base GEMMs and the input gradient in FP8;
* **the same, input gradient in bf16**: the weight dequantised in the bf16 GEMM of
  ``fp8_linear.fp8_weight_grad_input``;
* **the same, x kept in FP8**: the FP8 input gradient, and each node keeping the codes of its input
  for dA rather than the bf16 input (``kernels.hf.lora.SAVED_INPUT = "fp8"``).

``--mode accuracy``: a smaller model of the same widths (``--layers``, default 4; 2 on a CPU)
trained for ``--train-steps`` (default 200; 6 on a CPU) on a few repeated batches, from the same
adapters, once per entry of ``RUNS`` (the bf16 base; the FP8 base with the FP8 input gradient, with
the bf16 one, and with x kept in FP8; all patched): the loss curves, the last losses against the
bf16 run's, and the first step's adapter gradients against the bf16 run's (beside PEFT's own bf16
layers'); plus one layer's output error on inputs with outlier channels (a few channels a hundred
times the others, as real activations have).

``--mode 70b``: Llama-3.1-70B's shape (random weights) built on the meta device and materialised
one decoder layer at a time straight into FP8 (the bf16 model, 131 GiB, never exists), PEFT LoRA on
the seven projections, ``patch_llama(fp8_base=True)``, a few timed steps: tokens/s and the peak.
Gradient checkpointing with ``--checkpointing``.

Results go to ``runs/lora_fp8/<mode>_<gpu>.json`` (``--out``; ``--record`` writes
``assets/results/lora_fp8/``, the files chapter 18 reads).
"""

from __future__ import annotations

import argparse
import gc
import math

import torch

from kernels import runtime
from kernels.fp8_linear import Fp8Weight, convert_frozen_linears
from kernels.hf import lora as hf_lora
from kernels.hf.patch import patch_llama
from kernels.hf.presets import llama_config
from kernels.reference import relative_error

from . import cli
from .lora import GIB, build_llama, lora_config, make_batches, restore_adapters, time_steps
from .progress import progress_bar
from .results import device_slug, first_line, results_file

GROUP = "lora_fp8"
MODES = ("step", "accuracy", "70b")
LABELS = {
    "hf_peft": "Hugging Face + PEFT (bf16 base)",
    "patched_peft": "patch_llama + PEFT (bf16 base, fused LoRA)",
    "fp8_base": "patch_llama(fp8_base=True) + PEFT (FP8 base, FP8 input gradient)",
    "fp8_base_bf16_dx": "patch_llama(fp8_base=True) + PEFT (FP8 base, bf16 input gradient)",
    "fp8_base_saved_fp8": "patch_llama(fp8_base=True) + PEFT (FP8 base, x kept in FP8 for dA)",
}


def kernel_profile(net, batch: dict, optimizer, top: int = 25) -> dict:
    """One step under ``torch.profiler``: the GPU time of each kernel name, summed.

    Args:
        net: the model; batch: one batch; optimizer: stepped and zeroed in the step.
        top: how many kernel names to keep, longest first.

    Returns:
        ``{"total_us": …, "kernels": [[name, µs, calls], …]}`` (empty off the GPU).
    """
    from torch.profiler import ProfilerActivity, profile

    if not batch["input_ids"].is_cuda:
        return {"total_us": 0.0, "kernels": []}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        net(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[1])
    return {"total_us": sum(k[1] for k in kernels), "kernels": [[n[:120], us, c] for n, us, c in kernels[:top]]}


def _measure(rows: dict, name: str, net, batches, warmup: int, steps: int, initial: dict, log,
             profile: bool = False) -> None:
    """One setup's timed steps from the initial adapters with a fresh AdamW, into ``rows[name]``
    (with ``kernel_profile``'s table where ``profile``)."""
    log(f"  {LABELS[name]} …", flush=True)
    trained = restore_adapters(net, initial)
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=batches[0]["input_ids"].is_cuda)
    try:
        rows[name] = time_steps(net, batches, warmup, steps, optimizer)
        if profile:
            rows[name]["profile"] = kernel_profile(net, batches[0], optimizer)
    except torch.OutOfMemoryError as err:
        rows[name] = {"error": f"out of memory: {first_line(err)}"}
    rows[name]["label"] = LABELS[name]
    log(f"    {_row_text(rows[name])}", flush=True)


def run_step(preset: str, batch: int, seq: int, rank: int, alpha: float, warmup: int, steps: int,
             seed: int = 0, log=print, profile: bool = False) -> dict:
    """The four setups of the module docstring on one model, bf16 rows first.

    Args:
        preset, batch, seq: the model and the step's shape.
        rank, alpha: the adapters'.
        warmup, steps: untimed, then timed steps per setup.
        seed: the weights', batches' and adapters' seed.
        log: where progress lines go.
        profile: add ``kernel_profile``'s table to the fused bf16 row and the FP8 rows.

    Returns:
        ``rows`` (one per setup: timings or the error), ``speedups`` (each row's tokens/s over
        the fused bf16 row's and over Hugging Face's) and the FP8 switch's summary line.
    """
    import peft

    device = runtime.device()
    dtype = torch.bfloat16 if runtime.MODE == "gpu" else torch.float32
    model = build_llama(preset, dtype, device, seed)
    model.requires_grad_(False)
    batches = make_batches(model.config.vocab_size, batch, seq, 2, device, seed)
    wrapped = peft.get_peft_model(model, lora_config(rank, alpha))
    initial = {p: p.detach().clone() for p in wrapped.parameters() if p.requires_grad}
    rows = {}
    _measure(rows, "hf_peft", wrapped, batches, warmup, steps, initial, log)
    with patch_llama(wrapped):
        _measure(rows, "patched_peft", wrapped, batches, warmup, steps, initial, log, profile)
    gc.collect()
    handle = patch_llama(wrapped, fp8_base=True)
    gc.collect()
    _measure(rows, "fp8_base", wrapped, batches, warmup, steps, initial, log, profile)
    saved = hf_lora.GRAD_INPUT, hf_lora.SAVED_INPUT
    try:
        hf_lora.GRAD_INPUT = "bf16"
        _measure(rows, "fp8_base_bf16_dx", wrapped, batches, warmup, steps, initial, log, profile)
        hf_lora.GRAD_INPUT, hf_lora.SAVED_INPUT = "fp8", "fp8"
        _measure(rows, "fp8_base_saved_fp8", wrapped, batches, warmup, steps, initial, log)
    finally:
        hf_lora.GRAD_INPUT, hf_lora.SAVED_INPUT = saved
    summary = handle.summary()
    handle.undo()
    initial.clear()
    del wrapped, model
    gc.collect()
    return {"rows": rows, "speedups": speedups(rows), "fp8_summary": summary}


def speedups(rows: dict) -> dict:
    """Each timed row's tokens/s over the fused bf16 row's and over Hugging Face + PEFT's, and its
    peak's difference from the fused bf16 row's.

    Args:
        rows: ``run_step``'s rows.

    Returns:
        ``{name: {"vs_patched": …, "vs_hf": …, "peak_below_patched_gib": …}}`` for rows with timings.
    """
    def tps(name):
        return rows.get(name, {}).get("tokens_per_s")

    out = {}
    for name, row in rows.items():
        if tps(name) is None:
            continue
        entry = {}
        if tps("patched_peft"):
            entry["vs_patched"] = tps(name) / tps("patched_peft")
        if tps("hf_peft"):
            entry["vs_hf"] = tps(name) / tps("hf_peft")
        peak, base = row.get("peak_gib"), rows.get("patched_peft", {}).get("peak_gib")
        if peak is not None and base is not None:
            entry["peak_below_patched_gib"] = base - peak
        out[name] = entry
    return out


# --------------------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------------------


def _train(net, batches, train_steps: int, lr: float, initial: dict) -> list[float]:
    """``train_steps`` AdamW steps from the initial adapters; the losses."""
    trained = restore_adapters(net, initial)
    optimizer = torch.optim.AdamW(trained, lr=lr, fused=batches[0]["input_ids"].is_cuda)
    losses = []
    for i in progress_bar(range(train_steps), desc="steps"):
        loss = net(**batches[i % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def layer_output_error(n_in: int, n_out: int, tokens: int, device, seed: int = 0) -> dict:
    """One FP8 linear layer's output against the bf16 layer's, on plain and on outlier-heavy inputs.

    Args:
        n_in, n_out: the layer's sizes; tokens: rows of the input.
        device: where to run.
        seed: the draw's seed.

    Returns:
        ``{"plain": relative error, "outliers": relative error}`` of ``x·Ŵᵀ`` (x quantised per row,
        W per output channel) against the float64 product of the bf16 operands.
    """
    from kernels.fp8 import fp8_matmul, quantize_rows

    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, n_in, generator=gen) / math.sqrt(n_in)).to(device, torch.bfloat16)
    weight = Fp8Weight.from_linear(w)
    out = {}
    for name in ("plain", "outliers"):
        x = torch.randn(tokens, n_in, generator=gen)
        if name == "outliers":  # 1 % of the channels a hundred times the rest
            x[:, torch.randperm(n_in, generator=gen)[: max(1, n_in // 100)]] *= 100.0
        x = x.to(device, torch.bfloat16)
        xq, xs = quantize_rows(x)
        y = fp8_matmul(xq, xs, weight.q, weight.scale, out_dtype=torch.bfloat16)
        out[name] = relative_error(y, x.double() @ w.double().T)
    return out


def _first_grads(net, batch: dict, initial: dict) -> dict:
    """The adapters' gradients of one step from the initial adapters (float64, by name)."""
    restore_adapters(net, initial)
    trained = {n: p for n, p in net.named_parameters() if p.requires_grad}
    net(**batch).loss.backward()
    grads = {n: p.grad.double().clone() for n, p in trained.items()}
    net.zero_grad(set_to_none=True)
    return grads


def _grad_errors(grads: dict, reference: dict) -> dict:
    names = sorted(reference)
    return {"together": relative_error(torch.cat([grads[n].flatten() for n in names]),
                                       torch.cat([reference[n].flatten() for n in names])),
            "worst": max(relative_error(grads[n], reference[n]) for n in names)}


def _curve_summary(losses: list[float], reference: list[float], tail: int) -> dict:
    """The run's last losses against the reference run's, and both at a few steps."""
    last, last_ref = sum(losses[-tail:]) / tail, sum(reference[-tail:]) / tail
    marks = [i for i in (10, 25, 50, 100, 200, 400) if i <= len(losses)]
    return {"last": last, "last_ratio": last / last_ref, "last_difference": last - last_ref,
            "at_steps": {i: [losses[i - 1], reference[i - 1]] for i in marks},
            "first_below_1": next((i + 1 for i, v in enumerate(losses) if v < 1.0), None)}


RUNS = {"bf16": "bf16 base", "fp8": "FP8 base, FP8 input gradient", "fp8_bf16_dx": "FP8 base, bf16 input gradient",
        "fp8_saved_fp8": "FP8 base, x kept in FP8 for dA"}


def run_accuracy(preset: str, layers: int, batch: int, seq: int, rank: int, alpha: float, train_steps: int,
                 lr: float, seed: int = 0, log=print) -> dict:
    """The bf16-base and FP8-base LoRA runs of the module docstring, from the same adapters.

    Args:
        preset: the widths; layers: decoder layers kept.
        batch, seq: the batches' shape; rank, alpha: the adapters'.
        train_steps: optimizer steps per run; lr: AdamW's learning rate.
        seed: the weights', batches' and adapters' seed.
        log: where progress lines go.

    Returns:
        each run's loss curve (``RUNS``), the FP8 runs' last losses against the bf16 run's, the
        first step's adapter gradients against the bf16 run's (beside PEFT's own bf16 layers', the
        rounding differences of bf16 alone), and one layer's output errors.
    """
    import peft

    device = runtime.device()
    dtype = torch.bfloat16 if runtime.MODE == "gpu" else torch.float32
    model = build_llama(preset, dtype, device, seed, num_hidden_layers=layers)
    model.requires_grad_(False)
    batches = make_batches(model.config.vocab_size, batch, seq, 4, device, seed)
    wrapped = peft.get_peft_model(model, lora_config(rank, alpha))
    initial = {p: p.detach().clone() for p in wrapped.parameters() if p.requires_grad}
    # B starts at zero, so the first step's dA is zero: a draw for B makes every gradient informative.
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            initial[p] = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 0.01
    losses, grads = {}, {}
    with patch_llama(wrapped, lora=False):
        grads["peft_bf16"] = _first_grads(wrapped, batches[0], initial)
    saved = hf_lora.GRAD_INPUT, hf_lora.SAVED_INPUT
    try:
        for run in RUNS:
            log(f"  {RUNS[run]} …", flush=True)
            hf_lora.GRAD_INPUT = "bf16" if run == "fp8_bf16_dx" else "fp8"
            hf_lora.SAVED_INPUT = "fp8" if run == "fp8_saved_fp8" else "bf16"
            with patch_llama(wrapped, fp8_base=run != "bf16"):
                grads[run] = _first_grads(wrapped, batches[0], initial)
                losses[run] = _train(wrapped, batches, train_steps, lr, initial)
    finally:
        hf_lora.GRAD_INPUT, hf_lora.SAVED_INPUT = saved
    tail = max(1, train_steps // 20)  # the last 5 % of the steps, averaged: one batch's noise smoothed
    config = model.config
    return {
        "losses": losses, "tail_steps": tail,
        "curves": {run: _curve_summary(losses[run], losses["bf16"], tail) for run in RUNS},
        "grad_errors": {run: _grad_errors(grads[run], grads["bf16"]) for run in grads if run != "bf16"},
        "layer_error": layer_output_error(config.hidden_size, config.intermediate_size, 4096 if runtime.MODE == "gpu"
                                          else 16, device, seed),
    }


# --------------------------------------------------------------------------------------------------
# 70B on one GPU
# --------------------------------------------------------------------------------------------------


def _materialise(module: torch.nn.Module, device, std: float) -> None:
    """Give a meta module real storage on ``device`` and random values: linears and embeddings
    normal(0, std), norms ones, LoRA's A Kaiming-uniform (PEFT's default) and B zeros."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_A" in name:
                torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
            elif "lora_B" in name:
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def build_fp8_lora_llama(preset: str, rank: int, alpha: float, device, log=print) -> torch.nn.Module:
    """A PEFT LoRA Llama of ``preset`` whose frozen linears are FP8 from the start: built on the
    meta device, then one decoder layer at a time given bf16 storage, random weights, and
    converted (its bf16 weights freed before the next layer is made).

    Args:
        preset: a preset of ``kernels.hf.presets`` (``"llama-3.1-70b"`` for the 70B run).
        rank, alpha: the adapters'.
        device: the GPU.
        log: where progress lines go.

    Returns:
        The PEFT model in training mode, bf16 embeddings, norms and LM head, FP8 decoder linears.
    """
    import peft
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(preset)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.config.use_cache = False
    model.requires_grad_(False)
    wrapped = peft.get_peft_model(model, lora_config(rank, alpha))
    std = config.initializer_range
    inner = model.model
    for layer in progress_bar(inner.layers, desc="layers to FP8"):
        _materialise(layer, device, std)
        convert_frozen_linears(layer)
        torch.cuda.empty_cache()
    for module in (inner.embed_tokens, inner.norm, model.lm_head):
        _materialise(module, device, std)
    # Non-persistent buffers made on the meta device have no values to keep: built again.
    with torch.device(device):
        inner.rotary_emb = LlamaRotaryEmbedding(config)
    return wrapped.train()


def run_70b(preset: str, batch: int, seq: int, rank: int, alpha: float, warmup: int, steps: int,
            checkpointing: bool, log=print) -> dict:
    """The 70B LoRA step of the module docstring.

    Args:
        preset: the model's preset; batch, seq: the step's shape; rank, alpha: the adapters'.
        warmup, steps: untimed, then timed steps.
        checkpointing: gradient checkpointing on every decoder layer.
        log: where progress lines go.

    Returns:
        The step's timings (or the error), the parameters' count and the memory after building.
    """
    device = runtime.device()
    wrapped = build_fp8_lora_llama(preset, rank, alpha, device, log)
    if checkpointing:
        wrapped.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        wrapped.enable_input_require_grads()
    built_gib = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    handle = patch_llama(wrapped, fp8_base=True)
    batches = make_batches(wrapped.config.vocab_size, batch, seq, 2, device)
    trained = [p for p in wrapped.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")
    try:
        row = time_steps(wrapped, batches, warmup, steps, optimizer)
    except torch.OutOfMemoryError as err:
        row = {"error": f"out of memory: {first_line(err)}"}
    config = wrapped.config
    return {"row": row, "built_gib": built_gib, "summary": handle.summary(),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "trainable_parameters": sum(p.numel() for p in trained)}


# --------------------------------------------------------------------------------------------------
# Tables and the command line
# --------------------------------------------------------------------------------------------------


def _row_text(row: dict) -> str:
    if "error" in row:
        return row["error"]
    peak = f", peak {row['peak_gib']:.1f} GiB" if row.get("peak_gib") is not None else ""
    return (f"{row['tokens_per_s']:,.0f} tokens/s, {row['step_ms']:.0f} ms/step{peak}, "
            f"first loss {row['first_loss']:.4f}")


def format_table(result: dict) -> str:
    """The result as text: one line per setup (step), the losses and errors (accuracy), the 70B row.

    Args:
        result: what ``run`` returned.

    Returns:
        The lines, joined.
    """
    s = result["settings"]
    lines = [f"{result['mode']}: {s['preset']}, batch {s['batch']} × {s['seq']}, r={s['rank']} on {result['device']}"]
    if result["mode"] == "step":
        for name, row in result["rows"].items():
            ratio = result["speedups"].get(name, {})
            extra = (f"  ({ratio['vs_patched']:.2f}× fused bf16, {ratio['vs_hf']:.2f}× HF+PEFT)"
                     if "vs_patched" in ratio and "vs_hf" in ratio else "")
            lines.append(f"  {row['label']:<66} {_row_text(row)}{extra}")
        for name, row in result["rows"].items():
            if row.get("profile", {}).get("kernels"):
                lines.append(f"  {LABELS[name]}: one step's kernels, {row['profile']['total_us'] / 1e3:.1f} ms in all")
                lines += [f"    {us / 1e3:8.2f} ms {calls:5d}×  {kname[:90]}" for kname, us, calls in
                          row["profile"]["kernels"]]
    elif result["mode"] == "accuracy":
        for run, curve in result["curves"].items():
            lines.append(f"  {RUNS[run]:<32} last {result['tail_steps']} steps' mean loss {curve['last']:.4f} "
                         f"({curve['last_ratio']:.4f}× bf16's, {curve['last_difference']:+.4f}); below 1 from step "
                         f"{curve['first_below_1']}")
        for run, err in result["grad_errors"].items():
            what = "PEFT's own bf16 layers" if run == "peft_bf16" else RUNS[run]
            lines.append(f"  first step's adapter gradients, {what} against the fused bf16 run: "
                         f"{err['together']:.2%} together, worst tensor {err['worst']:.2%}")
        lines.append(f"  one layer's output vs bf16: {result['layer_error']['plain']:.2%} plain inputs, "
                     f"{result['layer_error']['outliers']:.2%} with outlier channels")
    else:
        lines.append(f"  {result['layers']} layers, built in {result['built_gib'] or 0:.1f} GiB: "
                     f"{_row_text(result['row'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace, log=print) -> dict:
    """Run the mode the flags name and return its result with the settings and the device.

    Args:
        args: the parsed flags.
        log: where progress lines go.

    Returns:
        The result dictionary that is printed and saved.
    """
    preset = args.preset or runtime.pick("tiny", "llama-3.1-70b" if args.mode == "70b" else "llama-3.1-8b")
    batch = args.batch or runtime.pick(1, 1 if args.mode == "70b" else 4)
    seq = args.seq or runtime.pick(37, 2048)
    warmup = args.warmup if args.warmup is not None else runtime.pick(0, 2)
    steps = args.steps or runtime.pick(1, 5)
    settings = dict(preset=preset, batch=batch, seq=seq, rank=args.rank, alpha=args.alpha, warmup=warmup,
                    steps=steps, checkpointing=args.checkpointing)
    log(runtime.describe())
    if args.mode == "step":
        body = run_step(preset, batch, seq, args.rank, args.alpha, warmup, steps, log=log, profile=args.profile)
    elif args.mode == "accuracy":
        layers, train_steps = args.layers or runtime.pick(2, 4), args.train_steps or runtime.pick(6, 200)
        settings.update(layers=layers, train_steps=train_steps, lr=args.lr)
        body = run_accuracy(preset, layers, batch, seq, args.rank, args.alpha, train_steps, args.lr, log=log)
    else:
        body = run_70b(preset, batch, seq, args.rank, args.alpha, warmup, steps, args.checkpointing, log=log)
    return {"group": GROUP, "mode": args.mode, "device": runtime.device_name(), "device_slug": device_slug(),
            "runtime": runtime.MODE, "settings": settings, **body}


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser.

    Returns:
        The ``argparse`` parser of ``python -m kernels.bench.lora_fp8``.
    """
    parser = argparse.ArgumentParser(prog="python -m kernels.bench.lora_fp8", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="step")
    parser.add_argument("--preset", default=None,
                        help="llama-3.1-8b (GPU default; llama-3.1-70b for --mode 70b), tiny (CPU default)")
    parser.add_argument("--batch", type=cli.positive_int, default=None, help="rows per step (default 4; 70b 1)")
    parser.add_argument("--seq", type=cli.positive_int, default=None, help="tokens per row (default 2048; CPU 37)")
    parser.add_argument("--rank", type=cli.positive_int, default=16)
    parser.add_argument("--alpha", type=cli.positive_float, default=32.0)
    parser.add_argument("--warmup", type=cli.non_negative_int, default=None)
    parser.add_argument("--steps", type=cli.positive_int, default=None, help="timed steps (default 5; CPU 1)")
    parser.add_argument("--layers", type=cli.positive_int, default=None,
                        help="decoder layers (accuracy mode; default 4, CPU 2)")
    parser.add_argument("--train-steps", type=cli.positive_int, default=None,
                        help="steps per run (accuracy mode; default 200, CPU 6)")
    parser.add_argument("--lr", type=cli.positive_float, default=1e-3, help="AdamW's rate (accuracy mode)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (70b mode)")
    parser.add_argument("--profile", action="store_true", help="each kernel's time in one step (step mode)")
    cli.add_output_arguments(parser, f"{GROUP}/<mode>_<gpu>.json")
    return parser


def main(argv=None) -> int:
    """``python -m kernels.bench.lora_fp8``: run, print the table, save the file.

    Args:
        argv: the arguments (``sys.argv[1:]`` when None).

    Returns:
        0; arguments it refuses end the process with status 2 before any work.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    path = results_file(GROUP, f"{args.mode}_{device_slug()}", cli.output_root(args))
    cli.check_outputs(parser, args, [path])
    result = run(args)
    print(format_table(result))
    print("saved", cli.write_json(path, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
