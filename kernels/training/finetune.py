"""Fine-tune a Llama preset with the workbook's kernels, optionally against Hugging Face's model as it is.

    python -m kernels.training.finetune --compare            # baseline and patched, table, JSON and loss-curve PNG
    python -m kernels.training.finetune --compare --fit      # also the longest sequence that fits, each way (GPU)
    python -m kernels.training.finetune                      # the patched run alone
    python -m kernels.training.finetune --lora 16 --compare  # Hugging Face + PEFT against patched + PEFT
    python -m kernels.training.finetune --optimizer-in-backward  # AdamW stepped inside the backward

Sharded across GPUs with FSDP2, the same flags run under torchrun from the distributed wing:
``torchrun --nproc-per-node 2 -m kernels.distributed.finetune --batch-size 2``.

Defaults: on a GPU, the largest preset that fits (``pick_preset_for_gpu``), 20 steps of one
2,048-token sequence; on the CPU, the tiny preset, 6 steps of 2 × 256 tokens with 2 micro-batches
per step (about a minute or less in Triton's interpreter). Results go to ``finetune/<name>.json``
and ``.png`` (``--name``, default the preset; ``<preset>_patched`` for the patched run alone) under
the results root: the git-ignored runs folder, ``--out``, or with ``--record`` the committed results
the chapters read (``assets/results/``). A file of that name is replaced only with ``--force``; the
flags a run ran with are the JSON's ``settings``, by which ``kernels.bench.results.find_run`` finds
it. Every flag is checked before any work (``kernels.bench.cli``).

Chapters 09 to 11 (notebooks/09_pytorch_ops.ipynb, 10_linear_cross_entropy.ipynb,
11_swiglu_rope.ipynb) read the runs of ``--compare`` it recorded, and give the command for a GPU.
"""

from __future__ import annotations

import argparse
import sys

from kernels import runtime
from kernels.bench import cli
from kernels.bench.results import results_file
from kernels.hf.patch import DEFAULT_KERNELS, SWITCHES
from kernels.hf.presets import PRESETS
from kernels.memory import logits_bytes_per_token

from .data import MIN_SEQ_LEN
from .fit import fit_both, memory_slope
from .loop import (
    ADAMW_IMPLEMENTATIONS,
    COMPILE_MODES,
    WARMUP_STEPS,
    Comparison,
    compare,
    default_lr,
    enable_checkpointing,
    make_run_batches,
    train,
)
from .models import GiB, llama_config, pick_preset_for_gpu

GPU_DEFAULTS = dict(steps=20, seq_len=2048, batch_size=1, grad_accum=1)
CPU_DEFAULTS = dict(steps=6, seq_len=256, batch_size=2, grad_accum=2)


def build_parser(writes: str = "finetune/<name>.json and .png") -> argparse.ArgumentParser:
    """The command line's parser, shared with ``kernels.distributed.finetune``.

    Its defaults for steps and shapes are ``GPU_DEFAULTS`` on a GPU, ``CPU_DEFAULTS`` elsewhere.

    Args:
        writes: what a run writes under the results root, for the help text of the output flags.

    Returns:
        The parser.
    """
    defaults = GPU_DEFAULTS if runtime.MODE == "gpu" else CPU_DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m kernels.training.finetune",
        description="Fine-tune a Llama preset (random weights, the workbook's SFT data) with the Triton RMSNorm and "
                    "cross-entropy patched in; with --compare, also Hugging Face's model as it is, from the same "
                    "weights on the same batches.",
    )
    p.add_argument("--preset", default=None, choices=tuple(PRESETS),
                   help="tiny, llama-3.2-1b or llama-3.1-8b (default: the largest that fits this GPU; tiny on the CPU)")
    p.add_argument("--steps", type=cli.positive_int, default=defaults["steps"],
                   help=f"optimizer steps (default {defaults['steps']})")
    p.add_argument("--seq-len", type=cli.positive_int, default=defaults["seq_len"],
                   help=f"tokens per row (default {defaults['seq_len']})")
    p.add_argument("--batch-size", type=cli.positive_int, default=defaults["batch_size"],
                   help=f"rows per micro-batch (default {defaults['batch_size']})")
    p.add_argument("--grad-accum", type=cli.positive_int, default=defaults["grad_accum"],
                   help=f"micro-batches per optimizer step (default {defaults['grad_accum']})")
    p.add_argument("--lr", type=cli.positive_float, default=None,
                   help=f"AdamW learning rate (default: {default_lr('tiny'):g} for tiny, "
                        f"{default_lr('llama-3.1-8b'):g} for the Llama shapes; see kernels.training.loop.default_lr)")
    p.add_argument("--seed", type=cli.non_negative_int, default=0,
                   help="seed of the weights and of the data order (default 0)")
    p.add_argument("--compare", action="store_true",
                   help="run Hugging Face's model first, then the patched one")
    p.add_argument("--fit", action="store_true",
                   help="also search the longest sequence at which a training step fits, baseline and patched (GPU)")
    p.add_argument("--fit-lo", type=cli.positive_int, default=None,
                   help=f"first length the fit search tries (with --fit; default {FIT_DEFAULTS['fit_lo']})")
    p.add_argument("--fit-hi", type=cli.positive_int, default=None,
                   help=f"longest length the fit search tries (with --fit; default {FIT_DEFAULTS['fit_hi']})")
    p.add_argument("--fit-probes", type=cli.positive_int, default=None,
                   help=f"most steps the fit search runs per variant (with --fit; default "
                        f"{FIT_DEFAULTS['fit_probes']})")
    p.add_argument("--memory-fraction", type=cli.fraction, default=None,
                   help="cap the fit search's GPU memory at this fraction of the GPU's (with --fit; a quicker search)")
    p.add_argument("--probe", type=cli.increasing_pair, default=None, metavar="A,B",
                   help="one real training step at each of two long lengths (e.g. 131072,262144) with the kernels "
                        "named by --kernels, then the longest length that fits this GPU and the host memory, "
                        "extrapolated from the two (GPU; with tiled_mlp and offload_checkpoints for the longest)")
    p.add_argument("--slope", type=cli.increasing_pair, default=None, metavar="A,B",
                   help="measure the activation memory per token, baseline and patched: the slope of a step's "
                        "peak between sequence lengths A and B (GPU)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES,
                   help="torch.compile both models (default mode, or the mode named; needs --compare). With "
                        "--kernels, name skip_causal_mask too, or the compiled patched model attends through the "
                        "full causal mask (kernels.hf.attention_mask)")
    p.add_argument("--kernels", type=_switches, default=None, metavar="NAME[,NAME...]",
                   help=f"which of patch_llama's kernels to turn on, from {', '.join(SWITCHES)} (default: "
                        f"patch_llama's kernels=\"auto\", every kernel of {', '.join(DEFAULT_KERNELS)} that applies "
                        "to the model)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="Hugging Face's activation checkpointing in every model run (non-reentrant)")
    p.add_argument("--no-padding-mask", dest="padding_mask", action="store_false",
                   help="leave out the attention mask of right-padded batches, in both runs: the same loss and "
                        "gradients without the [seq, seq] mask (kernels.hf.padding_mask)")
    p.add_argument("--adamw", choices=ADAMW_IMPLEMENTATIONS, default="foreach",
                   help="the AdamW of every run: torch.optim.AdamW's foreach (its default) or fused (one kernel, the "
                        "default optimizer of Hugging Face's Trainer), or this package's triton (kernels.adamw)")
    p.add_argument("--patched-adamw", choices=ADAMW_IMPLEMENTATIONS, default=None,
                   help="the AdamW of the patched run, if not --adamw's (e.g. --adamw fused --patched-adamw triton)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="step the patched run's parameters inside its backward, each as soon as its "
                        "gradient is final, and free the gradient (kernels.optim_in_backward; the "
                        "Triton AdamW kernel, so --patched-adamw, if given, must be triton; the baseline of "
                        "--compare keeps --adamw)")
    p.add_argument("--name", type=cli.file_name, default=None,
                   help="the results' name: finetune/NAME.json and .png under the results root (default: the "
                        "preset; <preset>_patched without --compare; under torchrun fsdp/NAME_<N>gpu.json); its "
                        "flags are in the JSON's settings")
    cli.add_output_arguments(p, writes)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--lora", type=cli.positive_int, default=None, metavar="RANK",
                   help="LoRA of this rank on q, k, v, o, gate, up, down (PEFT, dropout 0): with --compare, Hugging "
                        "Face + PEFT against patched + PEFT; results in lora/<name>.json")
    p.add_argument("--lora-alpha", type=cli.positive_float, default=None, metavar="A",
                   help="LoRA's alpha (with --lora; default 2 × RANK)")
    p.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)  # moved: main() says where to
    return p


def _switches(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SWITCHES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kernel {', '.join(unknown)}: choose from {', '.join(SWITCHES)}")
    return names


def patch_options(args) -> dict:
    """``patch_llama`` keywords from ``--kernels``: each switch on exactly when named.

    Args:
        args: the parsed flags.

    Returns:
        Switch -> on, for every switch of ``SWITCHES``; without ``--kernels``, an empty dict:
        patch_llama's default, ``kernels="auto"`` (every kernel of ``DEFAULT_KERNELS`` that
        applies).
    """
    if args.kernels is None:
        return {}
    return {name: name in args.kernels for name in SWITCHES}


def patched_adamw(args) -> str:
    """The AdamW of the patched run.

    Args:
        args: the parsed flags.

    Returns:
        ``--patched-adamw``, else ``"triton"`` with ``--optimizer-in-backward`` (its kernel), else
        ``--adamw``.
    """
    if args.patched_adamw is not None:
        return args.patched_adamw
    return "triton" if args.optimizer_in_backward else args.adamw


def _choose_preset(args) -> tuple[str, str]:
    if args.preset is not None:
        return args.preset, "chosen on the command line"
    if runtime.MODE == "gpu":
        return pick_preset_for_gpu(seq_len=args.seq_len, batch_size=args.batch_size)
    return "tiny", "no GPU: the tiny preset in Triton's interpreter"


def _fit(args, preset: str) -> dict:
    if runtime.MODE != "gpu":
        per_token = logits_bytes_per_token(llama_config(preset).vocab_size)
        print("--fit is GPU-only (the CPU has no device memory limit). Computed loss memory per token at V = "
              f"{llama_config(preset).vocab_size:,}: Hugging Face {per_token['baseline']:,} B, "
              f"patched {per_token['patched']:,} B.")
        return {}
    results = fit_both(preset, args.batch_size, fit_setting(args, "fit_lo"), fit_setting(args, "fit_hi"),
                       fit_setting(args, "fit_probes"), args.seed,
                       patch_options=patch_options(args), gradient_checkpointing=args.gradient_checkpointing,
                       memory_fraction=args.memory_fraction, padding_mask=args.padding_mask)
    for variant, result in results.items():
        print(f"longest sequence that fits, {variant}: {result.summary()}")
    return {variant: result.to_dict() for variant, result in results.items()}


def probe_longest(args, preset: str) -> int:
    """``--probe A,B``: two real steps of the patched model with the kernels of ``--kernels`` (the
    memory switches ``tiled_mlp`` and ``offload_checkpoints`` among them), and the longest length
    that fits, with its arithmetic (``kernels.training.long_context``; with the offload, checkpoints
    may split between the GPU and the host). Gradient checkpointing is on: without it no long length
    fits. Off the GPU it prints where to look instead and measures nothing. Chapter 14
    (notebooks/14_long_context.ipynb) teaches the probe.

    Args:
        args: the parsed flags (``--probe``, ``--kernels``, ``--no-progress``).
        preset: the model preset.

    Returns:
        The exit status, 0.
    """
    from .long_context import longest_that_fits, probe, probe_budgets

    if runtime.MODE != "gpu":
        print("--probe measures real steps on a GPU; on the CPU, kernels.training.long_context.memory_table counts "
              "the bytes from the shapes instead.")
        return 0
    options = patch_options(args) or {}
    memory = {name: options.pop(name, False) for name in ("tiled_mlp", "offload_checkpoints")}
    run = probe(preset, args.probe, kernels=options, tiled_mlp=memory["tiled_mlp"],
                offload=memory["offload_checkpoints"], progress=not args.no_progress)
    for point in run.points:
        peak = f"GPU peak {point.gpu_peak / GiB:.2f} GiB" if point.fits else f"does not fit ({point.error})"
        print(f"{point.seq_len:>9,} tokens: {peak}, host {point.host_bytes / GiB:.2f} GiB")
    # Offloaded checkpoints may stay on the GPU layer by layer when the host runs out first.
    layers = llama_config(preset).num_hidden_layers if memory["offload_checkpoints"] else 0
    print(longest_that_fits(run, *probe_budgets(), layers=layers).text)
    return 0


def _slope(args, preset: str) -> dict:
    """Activation memory per token, each variant, measured between the two lengths of ``--slope`` (GPU)."""
    if runtime.MODE != "gpu":
        print("--slope is GPU-only: the CPU keeps no memory statistics.")
        return {}
    found = {}
    for variant in ("baseline", "patched"):
        found[variant] = memory_slope(preset, variant == "patched", args.slope, args.batch_size,
                                      seed=args.seed,
                                      patch_options=patch_options(args),
                                      gradient_checkpointing=args.gradient_checkpointing,
                                      padding_mask=args.padding_mask)
        per_token = found[variant]["bytes_per_token"]
        shown = f"{per_token / 1024:,.0f} KiB" if per_token is not None else "n/a (a length did not fit)"
        print(f"activation memory per token, {variant}, between {args.slope[0]:,} and {args.slope[1]:,}: {shown}")
    return found


def _single_run(args, preset: str, lr: float) -> None:
    """The patched run alone: its numbers, a JSON and a loss-curve PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kernels.hf.patch import patch_llama

    from .models import build_model

    batches = make_run_batches(preset, args.steps, args.seq_len, args.batch_size, args.grad_accum, args.seed)
    model = build_model(preset, seed=args.seed)
    if args.gradient_checkpointing:
        enable_checkpointing(model)
    patch = patch_llama(model, **patch_options(args))
    run = train(model, batches, grad_accum=args.grad_accum, lr=lr, label="patched",
                progress=not args.no_progress,
                padding_mask=args.padding_mask, adamw=patched_adamw(args),
                optimizer_in_backward=args.optimizer_in_backward)
    patch.undo()
    peak = f"{run.peak_memory / GiB:.2f} GiB" if run.peak_memory is not None else "n/a (CPU)"
    print(f"patched: {run.tokens_per_s:,.0f} tokens/s (all tokens; {run.real_tokens_per_s:,.0f} non-padding), "
          f"{run.step_time_s * 1e3:,.1f} ms per step (first {run.warmup_steps} steps excluded), peak memory {peak}, "
          f"final loss {run.losses[-1]:.4f}")
    data = {"device": runtime.device_name(), "mode": runtime.MODE, "versions": runtime.versions(),
            "settings": _settings(args, preset, lr), "patched": run.to_dict(),
            "fit": _fit(args, preset) if args.fit else {},
            "slope": _slope(args, preset) if args.slope else {}}
    json_path = results_file("finetune", results_name(args, preset), cli.output_root(args))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r.step + 1 for r in run.records], run.losses, "x--", color="#c44e52", label="patched")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    cli.write_json_and_figure(json_path, data, fig, json_path.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print(f"wrote {json_path} and its .png")


def _settings(args, preset: str, lr: float) -> dict:
    return {"preset": preset, "steps": args.steps, "seq_len": args.seq_len, "batch_size": args.batch_size,
            "grad_accum": args.grad_accum, "lr": lr, "seed": args.seed, "dtype": "bfloat16",
            "warmup_steps": WARMUP_STEPS, "patch_options": patch_options(args),
            "gradient_checkpointing": args.gradient_checkpointing, "padding_mask": args.padding_mask,
            "adamw": args.adamw, "patched_adamw": patched_adamw(args),
            "optimizer_in_backward": args.optimizer_in_backward}


def results_name(args, preset: str) -> str:
    """The results' name: ``--name``, else the preset (``--compare``) or ``<preset>_patched`` (the
    patched run alone).

    Args:
        args: the parsed flags.
        preset: the model preset.

    Returns:
        The base name of the results files.
    """
    return args.name or (preset if args.compare else f"{preset}_patched")


def lora_results_paths(args, preset: str) -> tuple:
    """``lora/<name>.json`` and ``.png`` of a ``--lora RANK --compare`` run (name: ``--name``, else
    ``<preset>_r<RANK>``).

    Args:
        args: the parsed flags.
        preset: the model preset.

    Returns:
        The JSON path and the PNG path, under the results root of ``--out``/``--record``.
    """
    name = args.name or f"{preset}_r{args.lora}"
    root = cli.output_root(args)
    return results_file("lora", name, root), results_file("lora", name, root, suffix=".png")


# The fit search's flags when not given (None until then, so that a flag given without --fit is
# seen).
FIT_DEFAULTS = dict(fit_lo=4096, fit_hi=65536, fit_probes=8)


def fit_setting(args, name: str):
    """``args.<name>`` of the fit search, or its default (``FIT_DEFAULTS``) where the flag was not given.

    Args:
        args: the parsed flags.
        name: ``"fit_lo"``, ``"fit_hi"`` or ``"fit_probes"``.

    Returns:
        The flag's value, or its default.
    """
    value = getattr(args, name)
    return FIT_DEFAULTS[name] if value is None else value


def flag_problems(args) -> list[str]:
    """What is wrong with a combination of flags, one line each (each flag alone was checked as it
    was parsed). Shared with ``kernels.distributed.finetune``.

    Args:
        args: the parsed flags.

    Returns:
        One message per problem; empty when the flags go together.
    """
    problems = []
    if args.seq_len < MIN_SEQ_LEN:
        problems.append(f"--seq-len {args.seq_len} is shorter than any exchange of the workbook's dataset: use at "
                        f"least {MIN_SEQ_LEN}")
    lo, hi = fit_setting(args, "fit_lo"), fit_setting(args, "fit_hi")
    if lo > hi:
        problems.append(f"--fit-lo {lo} is above --fit-hi {hi}: the search needs lo ≤ hi")
    given = [flag for flag, value in (("--fit-lo", args.fit_lo), ("--fit-hi", args.fit_hi),
                                      ("--fit-probes", args.fit_probes),
                                      ("--memory-fraction", args.memory_fraction))
             if value is not None]
    if given and not args.fit:
        tune, them = ("tunes", "it") if len(given) == 1 else ("tune", "them")
        problems.append(f"{', '.join(given)} only {tune} the fit search: add --fit, or leave {them} out")
    if args.lora_alpha is not None and args.lora is None:
        problems.append("--lora-alpha sets the LoRA adapters' alpha: add --lora RANK, or leave it out")
    if args.optimizer_in_backward and patched_adamw(args) != "triton":
        problems.append("--optimizer-in-backward runs the Triton AdamW kernel: --patched-adamw "
                        f"{args.patched_adamw} cannot be it; leave --patched-adamw out, or name triton")
    if args.optimizer_in_backward and _under_torchrun():
        problems.append("--optimizer-in-backward steps whole parameters on one GPU; a sharded run's "
                        "gradients are reduce-scattered after its hooks would fire: leave it out under "
                        "torchrun (--adamw triton steps the shards)")
    if args.optimizer_in_backward and args.probe:
        problems.append("--probe measures memory with its own steps, not the training loop's: leave out "
                        "--optimizer-in-backward there")
    return problems


def _under_torchrun() -> bool:
    """Whether torchrun started this process (the distributed wing's command line shares these flags)."""
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_torchelastic_launched()


def check_args(parser: argparse.ArgumentParser, args, preset: str) -> None:
    """Every check before any work: the flags together, and the results files (none for ``--probe``).

    Args:
        parser: the parser, for the usage line of the error.
        args: the parsed flags.
        preset: the preset the run will use (the default results name is its name).

    Raises:
        SystemExit: with status 2 and one line per problem, on any
            (``kernels.bench.cli.check_outputs``).
    """
    problems = flag_problems(args)
    if args.fsdp:
        problems.append("sharded runs start under torchrun from the distributed wing, with the same flags: "
                        "torchrun --nproc-per-node N -m kernels.distributed.finetune ...")
    if args.compile and not args.compare and not args.probe:
        problems.append("--compile compares compiled models: use it with --compare")
    if args.lora is not None and (not args.compare or args.fit or args.slope or args.compile or args.probe):
        problems.append("--lora RANK runs with --compare, without --fit, --slope, --probe or --compile")
    for flag, on, why in (("--fit", args.fit, "it searches the longest sequence that fits the GPU's memory"),
                          ("--slope", args.slope, "it reads the GPU allocator's peaks"),
                          ("--probe", args.probe,
                           "it runs real training steps; kernels.training.long_context."
                                                 "memory_table counts the bytes from the shapes anywhere")):
        if on:
            problems += cli.gpu_problems(flag, why)
    root = cli.output_root(args)
    if args.lora is not None:
        targets = list(lora_results_paths(args, preset))
    else:
        targets = [] if args.probe else [results_file("finetune", results_name(args, preset), root, suffix)
                                         for suffix in (".json", ".png")]
    cli.check_outputs(parser, args, targets, problems)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_compare(args, preset: str, lr: float) -> int:
    """``--lora RANK --compare``: Hugging Face + PEFT, then patched + PEFT (the defaults and the
    ``lora`` switch, or ``--kernels``), from the same weights on the same batches;
    ``lora/<name>.json`` and ``.png``."""
    import matplotlib
    import peft
    import torch

    from kernels.hf.patch import patch_llama

    from .loop import free_memory
    from .models import build_model

    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora
    matplotlib.use("Agg")
    batches = make_run_batches(preset, args.steps, args.seq_len, args.batch_size, args.grad_accum, args.seed)
    runs = {}
    for variant in ("baseline", "patched"):
        free_memory()
        model = build_model(preset, dtype=torch.bfloat16, seed=args.seed)
        if args.gradient_checkpointing:
            enable_checkpointing(model)
        config = peft.LoraConfig(r=args.lora, lora_alpha=alpha, lora_dropout=0.0,
                                 target_modules=list(LORA_TARGETS))
        wrapped = peft.get_peft_model(model, config)
        # the defaults and the fused adapters, unless --kernels
        options = patch_options(args) or {"lora": True}
        handle = patch_llama(wrapped, **options) if variant == "patched" else None
        adamw = patched_adamw(args) if variant == "patched" else args.adamw
        runs[variant] = train(wrapped, batches, grad_accum=args.grad_accum, lr=lr, label=f"{variant} + PEFT",
                              progress=not args.no_progress, padding_mask=args.padding_mask, adamw=adamw,
                              optimizer_in_backward=args.optimizer_in_backward and variant == "patched")
        if handle is not None:
            handle.undo()
        del wrapped, model, handle
        free_memory()
    settings = {**_settings(args, preset, lr), "lora": {"rank": args.lora, "alpha": alpha, "dropout": 0.0,
                                                       "targets": list(LORA_TARGETS)}}
    result = Comparison(settings, runs["baseline"], runs["patched"])
    print()
    print(result.table())
    json_path, png_path = lora_results_paths(args, preset)
    fig = result.plot()[0].figure
    fig.tight_layout()
    cli.write_json_and_figure(json_path, result.to_dict(), fig, png_path, dpi=120)
    print(f"wrote {json_path} and {png_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line: check every flag, then probe, compare (with or without LoRA) or train
    the patched model alone, print the numbers and write the results.

    Args:
        argv: the arguments; None for ``sys.argv[1:]``.

    Returns:
        The exit status, 0.

    Raises:
        SystemExit: with status 2, on a bad flag or combination of flags, before any work.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    preset, why = _choose_preset(args)
    check_args(parser, args, preset)
    lr = args.lr if args.lr is not None else default_lr(preset)
    print(runtime.describe())
    print(f"preset {preset} ({why}); {args.steps} steps of {args.grad_accum} × {args.batch_size} × {args.seq_len} "
          f"tokens, AdamW lr {lr:g}, bf16")
    if args.probe:
        return probe_longest(args, preset)
    if args.lora is not None:
        return _lora_compare(args, preset, lr)
    if not args.compare:
        _single_run(args, preset, lr)
        return 0

    if args.compile and not args.padding_mask and args.kernels is not None and "skip_causal_mask" not in args.kernels:
        print("note: compiled, the patched model still attends through a full causal mask; name skip_causal_mask in "
              "--kernels for SDPA's causal path (kernels.hf.attention_mask)")

    import matplotlib

    matplotlib.use("Agg")
    result: Comparison = compare(preset, args.steps, args.seq_len, args.batch_size, args.grad_accum,
                                 lr, args.seed,
                                 progress=not args.no_progress, compile=args.compile,
                                 patch_options=patch_options(args),
                                 gradient_checkpointing=args.gradient_checkpointing,
                                 padding_mask=args.padding_mask, adamw=args.adamw,
                                 patched_adamw=patched_adamw(args),
                                 optimizer_in_backward=args.optimizer_in_backward)
    if args.fit:
        result.fit = _fit(args, preset)
    if args.slope:
        result.slope = _slope(args, preset)
    print()
    print(result.table())
    json_path, png_path = result.save(cli.output_root(args), name=results_name(args, preset))
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
