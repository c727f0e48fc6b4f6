"""The command lines' shared policy (``kernels.bench.cli``): every argument checked before any work, one line per
mistake and exit status 2, results into the git-ignored runs folder unless ``--out`` or ``--record`` say otherwise,
an existing results file replaced only with ``--force``, and a failed run leaving the old file as it was."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kernels import runtime
from kernels.bench import cli
from kernels.bench.results import RESULTS, device_slug

ROOT = Path(__file__).resolve().parents[2]
SLUG = device_slug()
CPU_ONLY = pytest.mark.skipif(runtime.MODE == "gpu", reason="CPU sizes; on a GPU these runs take minutes")


def _main(module: str):
    """``main`` of a command line, imported when called (the distributed wing imports torch.distributed)."""
    import importlib

    return importlib.import_module(module).main


# --------------------------------------------------------------------------------------------------------------------
# Argument types
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parse, good, bad", [
    (cli.positive_int, {"1": 1, "4_096": 4096, " 7 ": 7}, ["0", "-5", "1.5", "x", ""]),
    (cli.non_negative_int, {"0": 0, "3": 3}, ["-1", "0.5", "nope"]),
    (cli.positive_float, {"1e-5": 1e-5, "600": 600.0}, ["0", "-1", "nan", "inf", "x"]),
    (cli.non_negative_float, {"0": 0.0, "2.5": 2.5}, ["-0.1", "nan", "-inf"]),
    (cli.fraction, {"1": 1.0, "0.25": 0.25}, ["0", "1.5", "-0.5", "nan"]),
    (cli.positive_ints, {"8": (8,), "1024,4_096": (1024, 4096), "3, 5": (3, 5)}, ["", ",", "0,4", "4,-1", "1,,2", "a"]),
    (cli.increasing_pair, {"16384,32768": (16384, 32768)}, ["5", "8,8", "9,3", "1,2,3", "0,4"]),
])
def test_argument_types_take_what_they_should_and_refuse_the_rest(parse, good, bad):
    for text, value in good.items():
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_names_keeps_the_order_given_and_refuses_unknown_or_empty():
    parse = cli.names(("a", "b", "c"))
    assert parse("c, a,c") == ("c", "a")
    with pytest.raises(argparse.ArgumentTypeError, match="'z'"):
        parse("a,z")
    with pytest.raises(argparse.ArgumentTypeError, match="at least one"):
        parse(" , ")
    assert cli.names(("a",), allow_empty=True)("") == ()


# --------------------------------------------------------------------------------------------------------------------
# Where results go
# --------------------------------------------------------------------------------------------------------------------


def test_the_results_root_is_the_runs_folder_unless_out_or_record_say_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv(cli.RUNS_ENV, raising=False)
    parser = argparse.ArgumentParser()
    cli.add_output_arguments(parser, "x/<gpu>.json")
    assert cli.output_root(parser.parse_args([])) == ROOT / "runs" == cli.runs_dir()
    assert cli.output_root(parser.parse_args(["--record"])) == RESULTS
    assert cli.output_root(parser.parse_args(["--out", str(tmp_path)])) == tmp_path
    monkeypatch.setenv(cli.RUNS_ENV, str(tmp_path / "elsewhere"))
    assert cli.output_root(parser.parse_args([])) == tmp_path / "elsewhere"
    with pytest.raises(SystemExit):  # one place or the other, not both
        parser.parse_args(["--record", "--out", str(tmp_path)])


def test_the_runs_folder_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", "runs/rmsnorm/nvidia-h200.json"], cwd=ROOT)
    assert done.returncode == 0, "runs/ must be git-ignored (.gitignore)"


def test_path_checks_name_each_problem(tmp_path):
    a_file = tmp_path / "a.json"
    a_file.write_text("{}")
    assert cli.root_problems(tmp_path / "new" / "root") == []
    assert "is a file" in cli.root_problems(a_file)[0]
    assert "is a file, not a folder" in cli.root_problems(a_file / "below")[0]
    assert "exists: pass --force" in cli.file_problems(a_file, force=False)[0]
    assert cli.file_problems(a_file, force=True) == []
    assert "is a folder" in cli.file_problems(tmp_path, force=True)[0]
    assert cli.file_problems(tmp_path / "new" / "b.json", force=False) == []


def test_record_is_refused_without_a_gpu():
    args = argparse.Namespace(record=True)
    assert bool(cli.record_problems(args)) == (runtime.MODE != "gpu")
    assert cli.record_problems(argparse.Namespace(record=False)) == []


# --------------------------------------------------------------------------------------------------------------------
# Writing: complete or not at all
# --------------------------------------------------------------------------------------------------------------------


class _FailingFigure:
    """A figure whose savefig writes half a PNG, then fails (a full disk, say)."""

    def savefig(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError("No space left on device")


class _Figure:
    def savefig(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG new")


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_a_failed_write_leaves_both_old_files_and_no_temporary(tmp_path):
    json_path, png_path = tmp_path / "r.json", tmp_path / "r.png"
    json_path.write_text('{"old": true}\n')
    png_path.write_bytes(b"old png")
    with pytest.raises(OSError, match="No space"):
        cli.write_json_and_figure(json_path, {"new": True}, _FailingFigure(), png_path)
    assert json_path.read_text() == '{"old": true}\n' and png_path.read_bytes() == b"old png"
    assert _leftovers(tmp_path) == []
    with pytest.raises(TypeError):  # not JSON: nothing written at all
        cli.write_json(json_path, {"x": object()})
    assert json_path.read_text() == '{"old": true}\n' and _leftovers(tmp_path) == []


def test_a_complete_write_replaces_both(tmp_path):
    json_path, png_path = tmp_path / "deep" / "r.json", tmp_path / "deep" / "r.png"
    assert cli.write_json_and_figure(json_path, {"v": 1.5}, _Figure(), png_path) == (json_path, png_path)
    assert json.loads(json_path.read_text()) == {"v": 1.5} and png_path.read_bytes() == b"\x89PNG new"
    cli.write_json(json_path, [1, 2])
    assert json.loads(json_path.read_text()) == [1, 2] and _leftovers(json_path.parent) == []


# --------------------------------------------------------------------------------------------------------------------
# Every command line: each kind of mistake exits 2, before any work, with one line naming the flag
# --------------------------------------------------------------------------------------------------------------------

SWEEP = "kernels.bench.sweep"
OVERHEAD = "kernels.bench.overhead"
LINEAR_CE = "kernels.bench.linear_ce"
ADAMW = "kernels.bench.adamw"
CUDA = "kernels.bench.cuda_compare"
FINETUNE = "kernels.training.finetune"
LONG = "kernels.training.long_context"
PEAK = "kernels.training.peak_memory"
FSDP = "kernels.distributed.finetune"
SCALING = "kernels.distributed.scaling"
ATTENTION = "kernels.bench.attention"
LORA = "kernels.bench.lora"
BLOCKS = "kernels.bench.attention_blocks"
PACKED = "kernels.training.packed"

MISTAKES = [
    (SWEEP, ["--hidden", "0"], "argument --hidden: must be a positive integer, got '0'"),
    (SWEEP, ["--tokens", ""], "argument --tokens"),
    (SWEEP, ["--tokens", "16,-4"], "argument --tokens"),
    (SWEEP, ["--vocab", "-1"], "argument --vocab"),
    (SWEEP, ["--intermediate", "0"], "argument --intermediate"),
    (SWEEP, ["--head-dim", "7"], "must be even"),
    (SWEEP, ["--hidden-sweep-tokens", "0"], "argument --hidden-sweep-tokens"),
    (SWEEP, ["--rounds", "0"], "argument --rounds"),
    (SWEEP, ["--warmup", "-1"], "argument --warmup"),
    (SWEEP, ["--rep", "0"], "argument --rep"),
    (SWEEP, ["--seed", "-3"], "argument --seed"),
    (SWEEP, ["--impls", "nope"], "argument --impls: unknown 'nope'"),
    (SWEEP, ["--passes", "bwd"], "argument --passes"),
    (SWEEP, ["--kernel", "rmsnorm", "--impls", "fp32"], "none of them is an implementation of rmsnorm"),
    (OVERHEAD, ["--calls", "-5"], "argument --calls: must be a positive integer, got '-5'"),
    (OVERHEAD, ["--calls", "0"], "argument --calls"),
    (LINEAR_CE, ["--hidden", "0"], "argument --hidden"),
    (LINEAR_CE, ["--tokens", "8,0"], "argument --tokens"),
    (LINEAR_CE, ["--impls", "nope"], "argument --impls"),
    (ADAMW, ["--reps", "0"], "argument --reps"),
    (ADAMW, ["--preset", "llama-99b"], "argument --preset: invalid choice"),
    (CUDA, ["--rep", "0"], "argument --rep"),
    (CUDA, ["--warmup", "-2"], "argument --warmup"),
    (FINETUNE, ["--steps", "0"], "argument --steps"),
    (FINETUNE, ["--seq-len", "-8"], "argument --seq-len"),
    (FINETUNE, ["--batch-size", "0"], "argument --batch-size"),
    (FINETUNE, ["--grad-accum", "0"], "argument --grad-accum"),
    (FINETUNE, ["--lr", "0"], "argument --lr: must be a number > 0"),
    (FINETUNE, ["--lr", "nan"], "argument --lr: expected a finite number"),
    (FINETUNE, ["--memory-fraction", "1.5"], "argument --memory-fraction"),
    (FINETUNE, ["--fit-probes", "0"], "argument --fit-probes"),
    (FINETUNE, ["--fit-lo", "8192", "--fit-hi", "4096"], "--fit-lo 8192 is above --fit-hi 4096"),
    (FINETUNE, ["--slope", "8,4"], "argument --slope"),
    (FINETUNE, ["--name", "a/b"], "argument --name"),
    (FINETUNE, ["--seq-len", "3"], "--seq-len 3 is shorter than any exchange"),  # was a traceback after the setup
    (FINETUNE, ["--lora-alpha", "8"], "--lora-alpha sets the LoRA adapters' alpha: add --lora RANK"),
    (FINETUNE, ["--fit-lo", "1024"], "--fit-lo only tunes the fit search: add --fit"),
    (FINETUNE, ["--memory-fraction", "0.5", "--fit-probes", "3"], "--fit-probes, --memory-fraction only tune"),
    (FINETUNE, ["--preset", "tiny", "--compile"], "--compile compares compiled models"),
    (FSDP, ["--prefetch", "-1"], "argument --prefetch"),
    (FSDP, ["--steps", "0"], "argument --steps"),
    (FSDP, ["--fit"], "a sharded run trains the eager loop"),
    (LONG, ["--steps", "0"], "argument --steps"),
    (LONG, ["--timing-len", "-1"], "argument --timing-len"),
    (LONG, ["--check-split", "-1"], "argument --check-split"),
    (LONG, ["--probe", "8,8"], "argument --probe"),
    (LONG, ["--preset", "nope"], "argument --preset"),
    (LONG, ["--variants", "", "--timing-len", "0"], "nothing to run"),
    (PEAK, ["--lengths", "5"], "argument --lengths"),
    (PEAK, ["--variants", "nope"], "argument --variants"),
    (SCALING, ["--gpus", "0"], "argument --gpus"),
    (SCALING, ["--seq-lens", ""], "argument --seq-lens"),
    (SCALING, ["--steps", "0"], "argument --steps"),
    (SCALING, ["--timeout", "0"], "argument --timeout"),
    (SCALING, ["--variants", "both"], "argument --variants"),
    (ATTENTION, ["--seqs", "64", "0"], "argument --seqs"),
    (ATTENTION, ["--tokens", "-1"], "argument --tokens"),
    (LORA, ["--batch", "0"], "argument --batch"),
    (LORA, ["--alpha", "nan"], "argument --alpha"),
    (LORA, ["--setups", "hf_peft,nope"], "argument --setups: unknown 'nope'"),
    (LORA, ["--preset", "llama-99b"], "argument --preset: invalid choice"),
    (LORA, ["--name", "a/b"], "argument --name"),
    (BLOCKS, ["--seq", "0"], "argument --seq"),
    (BLOCKS, ["--kernels", "delta"], "argument --kernels: unknown 'delta'"),
    (BLOCKS, ["--documents", "100", "--seq", "50"], "--documents 100 is longer than a row of 50 tokens"),
    (PACKED, ["--examples", "0"], "argument --examples"),
    (PACKED, ["--max-len", "16"], "--max-len must be at least 32"),
    (PACKED, ["--max-len", "64", "--tokens", "48"], "--tokens 48 is below --max-len 64"),
    (PACKED, ["--name", "a/b"], "argument --name"),
]


def _refused(module: str, argv: list[str], capsys) -> str:
    """Run the command's main; it must exit 2 before printing anything (no work done); returns its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        _main(module)(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, (module, argv, err)
    assert out == "", f"{module} {argv} started work before refusing: {out[:300]}"
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("module, argv, says", MISTAKES, ids=[f"{m.split('.')[-1]} {' '.join(a)}" for m, a, _ in
                                                              MISTAKES])
def test_each_mistake_exits_2_with_a_line_naming_it(module, argv, says, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(cli.RUNS_ENV, str(tmp_path))
    err = _refused(module, argv, capsys)
    assert says in err, err


def test_several_mistakes_get_one_line_each(capsys, tmp_path):
    a_file = tmp_path / "a.json"
    a_file.write_text("{}")
    err = _refused(FINETUNE, ["--fit-lo", "9", "--fit-hi", "2", "--compile", "--out", str(a_file)], capsys)
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 4, err
    assert "--fit-lo 9 is above --fit-hi 2" in errors[0] and "--fit-lo, --fit-hi only tune" in errors[1]
    assert "--compile" in errors[2] and "is a file" in errors[3]


# The results file of each command's tiny run, under the results root; the arguments that make that run.
WRITERS = {
    SWEEP: (["--kernel", "rmsnorm"], f"rmsnorm/{SLUG}.json"),
    OVERHEAD: ([], f"overhead/{SLUG}.json"),
    LINEAR_CE: ([], f"linear_cross_entropy/{SLUG}.json"),
    ADAMW: ([], f"adamw/{SLUG}.json"),
    CUDA: ([], f"cuda_rmsnorm/{SLUG}.json"),
    FINETUNE: (["--preset", "tiny"], "finetune/tiny_patched.json"),
    FSDP: (["--preset", "tiny"], "fsdp/tiny_1gpu.json"),
    PEAK: ([], f"peak_memory/llama-3.2-1b_{SLUG}.json"),
    SCALING: (["--preset", "tiny"], "scaling/tiny.json"),
    ATTENTION: ([], f"attention/{SLUG}.json"),
    LORA: (["--preset", "tiny", "--batch", "1"], "lora/tiny_b1.json"),
    BLOCKS: ([], f"attention_blocks/{SLUG}.json"),
    PACKED: ([], "packing/tiny.json"),
}


@pytest.mark.parametrize("module", WRITERS)
def test_an_existing_results_file_is_refused_without_force(module, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv, relative = WRITERS[module]
    target = tmp_path / relative
    target.parent.mkdir(parents=True)
    target.write_text('{"good": "results"}\n')
    err = _refused(module, [*argv, "--out", str(tmp_path)], capsys)
    assert f"{target} exists: pass --force" in err
    assert target.read_text() == '{"good": "results"}\n'


@pytest.mark.parametrize("module", WRITERS)
def test_out_naming_a_file_is_refused_before_any_work(module, tmp_path, capsys):
    argv, _ = WRITERS[module]
    a_file = tmp_path / "results.json"
    a_file.write_text("{}")
    assert "is a file" in _refused(module, [*argv, "--out", str(a_file)], capsys)
    assert "is a file, not a folder" in _refused(module, [*argv, "--out", str(a_file / "below")], capsys)


@pytest.mark.skipif(runtime.MODE == "gpu", reason="checks the refusal without a GPU")
@pytest.mark.parametrize("module, argv, flag", [
    (PEAK, [], "this command"), (LONG, ["--preset", "tiny", "--probe", "64,128"], "this command"),
    (FINETUNE, ["--preset", "tiny", "--fit"], "--fit"),
    (FINETUNE, ["--preset", "tiny", "--slope", "64,128"], "--slope"),
    (FINETUNE, ["--preset", "tiny", "--probe", "64,128"], "--probe"),
])
def test_what_needs_a_gpu_is_refused_up_front_alike(module, argv, flag, capsys, tmp_path):
    # peak_memory said so and exited 0, long_context exited 1, finetune --fit and --slope ran the CPU training first.
    out = tmp_path / "run.json" if module == LONG else tmp_path
    err = _refused(module, [*argv, "--out", str(out)], capsys)
    assert f"error: {flag} needs a CUDA GPU" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where nothing can be created")
@pytest.mark.parametrize("module", [*WRITERS, LONG])
def test_out_where_nothing_can_be_created_is_refused_before_any_work(module, capsys):
    # /proc passes access()'s permission check for root: the runs used to find out when writing, after all the work.
    argv = WRITERS.get(module, ([], ""))[0]
    out = "/proc/kernels-results/run.json" if module == LONG else "/proc/kernels-results"
    assert "nothing can be created in /proc" in _refused(module, [*argv, "--out", out], capsys)


@pytest.mark.skipif(runtime.MODE == "gpu", reason="on a GPU --record is allowed")
@pytest.mark.parametrize("module", [*WRITERS, LONG])
def test_record_is_refused_in_the_interpreter(module, capsys):
    argv = WRITERS.get(module, ([], ""))[0]
    assert "--record replaces the committed results of a GPU run" in _refused(module, [*argv, "--record"], capsys)


def test_the_long_context_file_is_checked_like_the_others(tmp_path, capsys):
    existing = tmp_path / "run.json"
    existing.write_text('{"kept": 1}')
    assert f"{existing} exists: pass --force" in _refused(LONG, ["--out", str(existing)], capsys)
    assert "is a folder" in _refused(LONG, ["--out", str(tmp_path)], capsys)
    assert existing.read_text() == '{"kept": 1}'


def test_the_committed_finetune_result_is_never_the_default_target(capsys, monkeypatch, tmp_path):
    # The defect this policy removes: a CPU run named like a committed H200 result replaced it.
    committed = RESULTS / "finetune" / "every_kernel.json"
    monkeypatch.setenv(cli.RUNS_ENV, str(tmp_path))
    from kernels.training.finetune import build_parser, results_name

    args = build_parser().parse_args(["--preset", "tiny", "--name", "every_kernel"])
    assert cli.output_root(args) == tmp_path and results_name(args, "tiny") == "every_kernel"
    if committed.exists() and runtime.MODE != "gpu":
        before = committed.read_bytes()
        _refused(FINETUNE, ["--preset", "tiny", "--name", "every_kernel", "--record", "--force"], capsys)
        assert committed.read_bytes() == before


def test_a_user_mistake_on_the_real_command_line_has_no_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", SWEEP, "--hidden", "0"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("python -m kernels.bench.sweep: error: argument --hidden: must be "
                                                   "a positive integer, got '0'")


# --------------------------------------------------------------------------------------------------------------------
# Every command's default run: into the runs folder, no tracked file touched; a failed run keeps the old file
# --------------------------------------------------------------------------------------------------------------------

# Each command as run without --out or --record, with the smallest sizes its flags allow (CPU).
TINY_RUNS = [
    (SWEEP, ["--kernel", "rmsnorm", "--tokens", "4", "--hidden", "32", "--hidden-sweep", "none", "--impls", "ours",
             "--passes", "fwd", "--no-progress"], [f"rmsnorm/{SLUG}.json", f"rmsnorm/{SLUG}.png"]),
    (LINEAR_CE, ["--tokens", "4", "--hidden", "16", "--vocab", "64", "--impls", "ours,torch-fp32", "--no-progress"],
     [f"linear_cross_entropy/{SLUG}.json", f"linear_cross_entropy/{SLUG}.png"]),
    (ADAMW, ["--preset", "tiny", "--reps", "1"], [f"adamw/{SLUG}.json"]),
    (OVERHEAD, ["--calls", "2"], [f"overhead/{SLUG}.json", f"overhead/{SLUG}.png"]),
    (FINETUNE, ["--preset", "tiny", "--steps", "1", "--seq-len", "32", "--batch-size", "1", "--grad-accum", "1",
                "--no-progress"], ["finetune/tiny_patched.json", "finetune/tiny_patched.png"]),
    (ATTENTION, ["--seqs", "32", "--tokens", "32"], [f"attention/{SLUG}.json"]),
    (LORA, ["--preset", "tiny", "--seq", "13", "--setups", "floor_hf,patched_peft", "--no-micro"],
     ["lora/tiny_b1.json"]),
    (CUDA, ["--quick"], []),  # interpreter timings: saved only where --out asks
]


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture
def runs_in_repo(monkeypatch):
    """The runs folder inside this checkout's git-ignored runs/ (a fresh subfolder, removed afterwards), cwd at the
    repository root: where a user's command lands."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    folder = ROOT / "runs" / f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(cli.RUNS_ENV, str(folder))
    monkeypatch.chdir(ROOT)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@CPU_ONLY
def test_every_default_run_writes_into_the_runs_folder_and_touches_no_tracked_file(runs_in_repo, capsys):
    before = _git_status()
    for module, argv, written in TINY_RUNS:
        assert _main(module)(argv) == 0, module
        for relative in written:
            assert (runs_in_repo / relative).stat().st_size > 0, (module, relative)
    assert _git_status() == before, "a command line changed the working tree outside the git-ignored runs folder"
    assert json.loads((runs_in_repo / f"adamw/{SLUG}.json").read_text())["preset"] == "tiny"
    assert _leftovers(runs_in_repo / "adamw") == []
    capsys.readouterr()
    # A second run of the same command does not replace the first one's file unless asked.
    module, argv, (relative, _) = TINY_RUNS[0]
    first = (runs_in_repo / relative).read_text()
    _refused(module, argv, capsys)
    assert (runs_in_repo / relative).read_text() == first
    assert _main(module)([*argv, "--seed", "1", "--force"]) == 0
    assert json.loads((runs_in_repo / relative).read_text())["settings"]["seed"] == 1


def test_the_distributed_commands_default_to_the_runs_folder(monkeypatch, tmp_path):
    # They start torchrun processes (tests/distributed/test_scaling.py and tests/distributed/test_distributed.py
    # run them): here the policy.
    monkeypatch.setenv(cli.RUNS_ENV, str(tmp_path))
    from kernels.distributed.finetune import build_fsdp_parser
    from kernels.distributed.scaling import build_parser

    for parser in (build_fsdp_parser(), build_parser()):
        assert cli.output_root(parser.parse_args([])) == tmp_path
        assert cli.output_root(parser.parse_args(["--record"])) == RESULTS


def test_the_sharded_batch_is_checked_against_the_world_size_before_the_group_starts(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(cli.RUNS_ENV, str(tmp_path))
    assert "make it a multiple of 2" in _refused(FSDP, ["--batch-size", "3"], capsys)


@CPU_ONLY
def test_a_failed_run_exits_non_zero_and_keeps_the_old_file(tmp_path, monkeypatch):
    import matplotlib.figure

    from kernels.training import finetune

    old = {"finetune/tiny_patched.json": '{"good": "run"}\n', "finetune/tiny_patched.png": "old plot"}
    for relative, text in old.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    argv = ["--preset", "tiny", "--steps", "1", "--seq-len", "32", "--batch-size", "1", "--grad-accum",
            "1", "--no-progress", "--out", str(tmp_path), "--force"]

    def broken(*args, **kwargs):
        raise RuntimeError("the run broke")

    monkeypatch.setattr(finetune, "train", broken)  # the run itself fails
    with pytest.raises(RuntimeError, match="the run broke"):
        finetune.main(argv)
    monkeypatch.undo()

    def disk_full(self, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", disk_full)  # the run finishes, its writing fails
    with pytest.raises(OSError, match="No space"):
        finetune.main(argv)
    for relative, text in old.items():
        assert (tmp_path / relative).read_text() == text
    assert _leftovers(tmp_path / "finetune") == []


@pytest.mark.gpu
def test_on_a_gpu_the_default_runs_leave_the_committed_results_alone(runs_in_repo, capsys):
    # On a GPU the device slug is the committed files' own (nvidia-h200.json): the default must still be runs/.
    before = _git_status()
    committed = {p: p.read_bytes() for p in RESULTS.rglob("*.json")}
    sweep = ["--kernel", "rmsnorm", "--tokens", "1024", "--hidden", "512", "--hidden-sweep", "none", "--impls", "ours",
             "--passes", "fwd", "--warmup", "1", "--rep", "2", "--rounds", "1", "--no-progress"]
    assert _main(SWEEP)(sweep) == 0
    assert _main(OVERHEAD)(["--calls", "20"]) == 0
    assert (runs_in_repo / f"rmsnorm/{SLUG}.json").exists() and (runs_in_repo / f"overhead/{SLUG}.json").exists()
    assert _git_status() == before
    assert all(path.read_bytes() == data for path, data in committed.items())
    capsys.readouterr()
    assert "exists: pass --force" in _refused(SWEEP, sweep, capsys)  # a second run asks before replacing the first
