"""The fine-tuning command line under torchrun: FSDP2 across the processes torchrun starts.

    torchrun --nproc-per-node 2 -m kernels.distributed.finetune --batch-size 2             # patched; 2 global rows
    torchrun --nproc-per-node 2 -m kernels.distributed.finetune --batch-size 2 --compare   # HF's, then patched
    torchrun --nproc-per-node 2 -m kernels.distributed.finetune --batch-size 2 --adamw triton

It takes every flag of the single-GPU command line (``python -m kernels.training.finetune``), whose
parser it extends with the sharding flags below, and runs
``kernels.distributed.parallel.fsdp_finetune`` in each process: rank 0 prints, logs and writes
``fsdp/<name>_<N>gpu.json`` under the results root (``--name`` defaults to the preset): the runs
folder, ``--out``, or with ``--record`` the committed results; an existing file only with
``--force``. It lives in this wing, not beside the single-GPU command line, because the training
wing sits below the distributed one and must not import it.
"""

from __future__ import annotations

import argparse
import os
import sys

from kernels import runtime
from kernels.bench import cli
from kernels.training.finetune import build_parser, flag_problems, patch_options
from kernels.training.loop import VARIANTS

from .fsdp import print0, setup, teardown
from .parallel import DTYPES, fsdp_finetune, fsdp_results_file


def add_fsdp_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags a sharded run takes on top of the single-GPU command line's.

    Args:
        parser: the parser to extend (``build_fsdp_parser`` passes the single-GPU one).
    """
    group = parser.add_argument_group("FSDP2 (under torchrun)")
    group.add_argument("--baseline", action="store_true",
                       help="Hugging Face's model alone, not patched (--compare runs both)")
    group.add_argument("--master-dtype", choices=sorted(DTYPES), default="bfloat16",
                       help="dtype of the stored (sharded) parameters and AdamW's states (default bfloat16, as the "
                            "single-GPU loop; float32 for float32 master weights)")
    group.add_argument("--prefetch", type=cli.non_negative_int, default=0, metavar="K",
                       help="all-gather K layers ahead explicitly (default 0: FSDP2's implicit one-layer prefetch)")
    group.add_argument("--profile-steps", type=cli.non_negative_int, default=0, metavar="K",
                       help="after each variant's timed run, profile K more steps on rank 0: compute against "
                            "collective kernel time, the collectives' exposed time, bytes sent (default 0: none)")
    group.add_argument("--compute-dtype", choices=sorted(DTYPES), default="bfloat16",
                       help="dtype the layers compute in (MixedPrecisionPolicy.param_dtype; default bfloat16)")


def build_fsdp_parser() -> argparse.ArgumentParser:
    """The sharded run's command line: the single-GPU fine-tuning flags plus ``add_fsdp_arguments``.

    Returns:
        the parser, its ``prog`` the ``torchrun`` command that runs it.
    """
    parser = build_parser(writes="fsdp/<name>_<N>gpu.json")
    parser.prog = "torchrun --nproc-per-node N -m kernels.distributed.finetune"
    parser.description = ("Fine-tune a Llama preset sharded with FSDP2 across the processes torchrun starts; "
                          "--batch-size is the global rows per micro-batch, split evenly across ranks (default "
                          "preset: llama-3.1-8b on GPUs, tiny on the CPU).")
    add_fsdp_arguments(parser)
    return parser


def _variants(args) -> tuple[str, ...]:
    if args.compare:
        return VARIANTS
    return ("baseline",) if args.baseline else ("patched",)


def _preset(args) -> str:
    return args.preset or ("tiny" if runtime.MODE != "gpu" else "llama-3.1-8b")


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Every check before the process group starts (each rank checks, so all stop together): the
    flags a sharded run refuses, and the results file rank 0 will write
    (``fsdp/<name>_<N>gpu.json``, N from torchrun's WORLD_SIZE).

    Args:
        parser: the parser (its ``error`` reports the problems and exits).
        args: the parsed flags.
    """
    problems = flag_problems(args)
    if args.compile or args.fit or args.probe or args.slope:
        problems.append("a sharded run trains the eager loop: leave out --compile, --fit, --probe and --slope")
    if args.adamw == "fused" or args.patched_adamw is not None:
        problems.append("a sharded run trains every variant with torch.optim.AdamW's defaults or with --adamw "
                        "triton: leave out --adamw fused and --patched-adamw")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % world_size:
        problems.append(f"--batch-size {args.batch_size} is the global batch, split by rows across {world_size} "
                        f"processes: make it a multiple of {world_size}, e.g. --batch-size "
                        f"{args.batch_size * world_size} for {args.batch_size} row(s) per process")
    target = fsdp_results_file(args.name or _preset(args), world_size, cli.output_root(args))
    cli.check_outputs(parser, args, [target], problems)


def main(argv: list[str] | None = None) -> int:
    """One torchrun worker's run: check the flags, join the process group, train every variant,
    leave the group.

    Chapter 12 launches it through ``kernels.distributed.parallel.launch``.

    Args:
        argv: the command line's arguments (None: ``sys.argv``'s).

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse`` before the group starts).
    """
    parser = build_fsdp_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    import matplotlib

    matplotlib.use("Agg")
    env = setup()
    try:
        preset = _preset(args)
        print0(runtime.describe())
        print0(f"FSDP2 on {env.world_size} rank(s), backend {env.backend}; preset {preset}; {args.steps} steps of "
               f"{args.grad_accum} × {args.batch_size} (global rows; {args.batch_size // max(env.world_size, 1)} "
               f"per rank) × {args.seq_len} tokens; stored {args.master_dtype}, compute {args.compute_dtype}, "
               "gradients reduced in float32")
        result = fsdp_finetune(
            preset, args.steps, args.seq_len, args.batch_size, args.grad_accum, args.lr, args.seed,
            variants=_variants(args), master_dtype=DTYPES[args.master_dtype],
            compute_dtype=DTYPES[args.compute_dtype], patch_options=patch_options(args),
            gradient_checkpointing=args.gradient_checkpointing, padding_mask=args.padding_mask,
            prefetch=args.prefetch,
            progress=not args.no_progress, out_dir=cli.output_root(args), adamw=args.adamw, name=args.name,
            profile_steps=args.profile_steps,
        )
        print0()
        print0(result.table())
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
