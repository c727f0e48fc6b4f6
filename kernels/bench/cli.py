"""What every command line of the package shares: argument types that check, where results go, and
safe writes.

The policy, the same for every ``python -m kernels....`` command that writes results:

* **Arguments are checked before any work.** Numbers are checked as argparse parses them
  (``positive_int``, ``fraction``, ``positive_ints``, ...); what depends on several flags, and the
  output paths, is checked right after parsing (``check_outputs``, ``fail``). A mistake exits with
  status 2 and one line per mistake naming the flag, no traceback; a traceback means a bug.
* **A run writes into the runs folder** (``runs_dir()``: ``runs/`` at the repository root,
  git-ignored; the environment variable ``KERNELS_RUNS_DIR`` moves it), in the layout of the
  committed results (``<root>/<group>/<name>.json``). ``--out`` names another results root.
  ``--record`` writes the committed reference results, exactly where the chapters read them
  (``kernels.bench.results.RESULTS``); the committed files come from GPU runs, so ``--record`` is
  refused without a GPU.
* **An existing results file is replaced only with ``--force``.** Never a tracked file by accident,
  nor the last run's file.
* **A failed run leaves the earlier file as it was.** Results are written to a temporary file beside
  the target and renamed over it only once complete (``replacing``, ``write_json``,
  ``write_json_and_figure``), so an exception, a full disk or an interrupt midway never leaves half
  a file where a good one was, nor a new JSON beside an old plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kernels import runtime

from .results import RESULTS, device_slug, results_file

REPO = RESULTS.parents[1]
RUNS_ENV = "KERNELS_RUNS_DIR"


# --------------------------------------------------------------------------------------------------
# Argument types: each raises argparse.ArgumentTypeError, which argparse reports as "argument
# --flag: <message>"
# --------------------------------------------------------------------------------------------------


def _integer(text: str) -> int:
    try:
        return int(str(text).strip().replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(str(text).strip().replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):  # NaN or infinite: no setting means that
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1 (sizes, counts, steps).

    Args:
        text: the flag's value.

    Returns:
        the integer.

    Raises:
        argparse.ArgumentTypeError: when it is not an integer ≥ 1.
    """
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer ≥ 0 (a seed; a length where 0 means "skip").

    Args:
        text: the flag's value.

    Returns:
        the integer.

    Raises:
        argparse.ArgumentTypeError: when it is not an integer ≥ 0.
    """
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a learning rate, a timeout in seconds).

    Args:
        text: the flag's value.

    Returns:
        the number.

    Raises:
        argparse.ArgumentTypeError: when it is not a finite number > 0.
    """
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0.

    Args:
        text: the flag's value.

    Returns:
        the number.

    Raises:
        argparse.ArgumentTypeError: when it is not a finite number ≥ 0.
    """
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number ≥ 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1] (a share of the GPU's memory).

    Args:
        text: the flag's value.

    Returns:
        the number.

    Raises:
        argparse.ArgumentTypeError: when it is not a number in (0, 1].
    """
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """A non-empty comma-separated list of positive integers, e.g. ``1024,4096`` (``_`` allowed:
    ``131_072``).

    Args:
        text: the flag's value.

    Returns:
        the integers, in the order given.

    Raises:
        argparse.ArgumentTypeError: when the list is empty, has an empty item or a non-positive one.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    values = []
    for part in parts:
        if not part:
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}: expected integers separated by commas")
        try:
            values.append(positive_int(part))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    return tuple(values)


def increasing_pair(text: str) -> tuple[int, int]:
    """Two positive integers, the first smaller: two lengths to measure between (``16384,32768``).

    Args:
        text: the flag's value.

    Returns:
        the two integers.

    Raises:
        argparse.ArgumentTypeError: unless it is two positive integers, the first smaller.
    """
    values = positive_ints(text)
    if len(values) != 2 or not values[0] < values[1]:
        raise argparse.ArgumentTypeError(f"expected two increasing positive integers such as 16384,32768, "
                                         f"got {text!r}")
    return values


def file_name(text: str) -> str:
    """A results name (``--name``): a file name without a folder, as ``results_file`` takes it.

    Args:
        text: the flag's value.

    Returns:
        the name, unchanged.

    Raises:
        argparse.ArgumentTypeError: when it is empty or holds a folder.
    """
    try:
        results_file("runs", text)  # the group does not matter: only the name is checked
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def names(choices: Iterable[str], *, allow_empty: bool = False) -> Callable[[str], tuple[str, ...]]:
    """An argument type: comma-separated names, each one of ``choices``, in the order given, without repeats;
    empty only where ``allow_empty``.

    Args:
        choices: the known names.
        allow_empty: accept an empty list.

    Returns:
        the parser of the flag's value, which returns the names as a tuple and raises
        ``argparse.ArgumentTypeError`` on an unknown name (or an empty list, unless allowed).
    """
    known = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        given = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
        unknown = [n for n in given if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}: choose from "
                                             f"{', '.join(known)}")
        if not given and not allow_empty:
            raise argparse.ArgumentTypeError(f"name at least one of {', '.join(known)}")
        return given

    parse.__name__ = "names"  # what argparse calls the type in its messages
    return parse


# --------------------------------------------------------------------------------------------------
# Where results go
# --------------------------------------------------------------------------------------------------


def runs_dir() -> Path:
    """The git-ignored folder command-line runs write into by default: ``runs/`` at the repository root, or
    ``$KERNELS_RUNS_DIR``.

    Returns:
        the folder (not created here).
    """
    return Path(os.environ.get(RUNS_ENV) or REPO / "runs")


def add_output_arguments(parser: argparse.ArgumentParser, what: str, *,
                         out_flags: tuple[str, ...] = ("--out",),
                         out_is_file: bool = False,
                         force_help: str = "replace a results file that already exists") -> None:
    """``--out``, ``--record`` and ``--force``. ``what`` says what a run writes
    (``"rmsnorm/<gpu>.json and .png"``), relative to the results root; where ``out_is_file``,
    ``--out`` names the file itself.

    Args:
        parser: the command's parser.
        what: what a run writes, for the help.
        out_flags: the names of the ``--out`` flag.
        out_is_file: ``--out`` names the results file, not the results root.
        force_help: the help of ``--force``.
    """
    group = parser.add_argument_group("where the results go")
    where = group.add_mutually_exclusive_group()
    if out_is_file:
        where.add_argument(*out_flags, dest="out", type=Path, default=None, metavar="FILE",
                           help=f"the results file (default: {_short(runs_dir())}/{what})")
    else:
        where.add_argument(*out_flags, dest="out", type=Path, default=None, metavar="DIR",
                           help=f"results root: writes {what} there (default: {_short(runs_dir())}, git-ignored)")
    where.add_argument("--record", action="store_true",
                       help=f"replace the committed reference results the chapters read ({_short(RESULTS)}/{what}); "
                            "GPU runs only")
    group.add_argument("--force", action="store_true", help=force_help)


def _short(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO.resolve()))
    except ValueError:
        return str(path)


def output_root(args: argparse.Namespace) -> Path:
    """The results root of this run: ``--out``, else the committed results with ``--record``, else
    the runs folder.

    Args:
        args: the parsed flags.

    Returns:
        the folder.
    """
    if getattr(args, "out", None) is not None:
        return Path(args.out)
    return RESULTS if getattr(args, "record", False) else runs_dir()


def root_problems(root: Path, flag: str = "--out") -> list[str]:
    """Why ``root`` cannot be a results root (a folder that exists or can be created), one line
    each; [] if it can.

    Args:
        root: the folder.
        flag: the flag that named it, for the messages.

    Returns:
        the problems.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        return [f"{flag} {root} is a file: {flag} names a folder, the results root (the run writes <group>/<name>.json "
                "inside it)"]
    return _creatable(root.parent if not root.exists() else root, flag, root)


def file_problems(path: Path, force: bool, flag: str = "--out") -> list[str]:
    """Why results cannot be written to ``path``, one line each; [] if they can. An existing file is
    refused unless ``force``.

    Args:
        path: the file.
        force: replace a file that exists.
        flag: the flag that named it, for the messages.

    Returns:
        the problems.
    """
    path = Path(path)
    if path.is_dir():
        return [f"{flag}: {path} is a folder, not a results file"]
    if path.exists() and not force:
        return [f"{path} exists: pass --force to replace it (or --out to write elsewhere)"]
    return _creatable(path.parent, flag, path)


def _creatable(folder: Path, flag: str, target: Path) -> list[str]:
    ancestor = Path(folder)
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        return [f"{flag}: cannot create {target}: {ancestor} is a file, not a folder"]
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return [f"{flag}: cannot write {target}: {ancestor} is not writable"]
    # access() answers from the permission bits, which root passes everywhere: /proc and a read-only
    # mount say writable, and the run would find out only when it writes its results. Creating a
    # folder there says.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=ancestor))
    except OSError as err:
        return [f"{flag}: cannot write {target}: nothing can be created in {ancestor} ({err.strerror})"]
    return []


def record_problems(args: argparse.Namespace) -> list[str]:
    """``--record`` writes the committed results, which are GPU runs: refused in Triton's interpreter.

    Args:
        args: the parsed flags.

    Returns:
        one line when ``--record`` is given without a GPU, else [].
    """
    if getattr(args, "record", False) and runtime.MODE != "gpu":
        return ["--record replaces the committed results of a GPU run; this machine runs Triton's interpreter "
                "(leave out --record: the run goes to the runs folder)"]
    return []


def gpu_problems(what: str, why: str) -> list[str]:
    """``[one line]`` saying that ``what`` needs a CUDA GPU (``why``), in Triton's interpreter or
    where no CUDA device answers; [] on a GPU. Commands refuse such runs with the other argument
    mistakes: exit 2 before any work.

    Args:
        what: the command, for the message.
        why: what it needs the GPU for.

    Returns:
        the problems.
    """
    import torch

    if runtime.MODE == "gpu" and torch.cuda.is_available():
        return []
    return [f"{what} needs a CUDA GPU ({why}); this machine runs Triton's interpreter"]


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace, targets: Iterable[Path],
                  problems: Iterable[str] = (), *, out_is_file: bool = False) -> None:
    """Check the results root (unless ``--out`` names the file itself) and every file this run will
    write (``targets``), with the ``problems`` the command found itself; on any, ``fail``. Call it
    right after parsing, before any work.

    Args:
        parser: the command's parser.
        args: the parsed flags.
        targets: the files the run will write.
        problems: the command's own problems.
        out_is_file: ``--out`` names the file itself (no results root to check).

    Raises:
        SystemExit: with status 2, on any problem.
    """
    found = [*problems, *record_problems(args)]
    where = [] if out_is_file else root_problems(output_root(args))
    if not where:  # the files' own checks would only repeat a bad root
        for target in targets:
            where += file_problems(target, getattr(args, "force", False))
    fail(parser, found + where)


def run_command(parser: argparse.ArgumentParser, argv, group: str, work: Callable[[argparse.Namespace], dict],
                table: Callable[[dict], str],
                problems: Callable[[argparse.Namespace], list[str]] | None = None) -> int:
    """The body of a benchmark's ``main``: parse ``argv``, check where the results go before any
    work (``<root>/<group>/<gpu>.json``; none under ``--no-save``), print this machine, run
    ``work(args)``, print ``table(result)`` and write the result.

    Args:
        parser: the command's parser (with ``add_output_arguments`` and ``--no-save``).
        argv: the command line's arguments (None: ``sys.argv``'s).
        group: the results group.
        work: runs the benchmark from the parsed flags and returns its result.
        table: the result as text.
        problems: the command's own checks of its flags (one line each), run with the outputs'.

    Returns:
        the exit status, 0 (a refused flag exits through ``argparse``).
    """
    args = parser.parse_args(argv)
    path = results_file(group, device_slug(), output_root(args))
    save = not getattr(args, "no_save", False)
    check_outputs(parser, args, [path] if save else [], problems(args) if problems else ())
    print(runtime.describe())
    result = work(args)
    print(table(result))
    if save:
        print("saved", write_json(path, result))
    return 0


def fail(parser: argparse.ArgumentParser, problems: Iterable[str]) -> None:
    """Exit with status 2, argparse's usage line and one ``prog: error: ...`` line per problem;
    nothing if none.

    Args:
        parser: the command's parser.
        problems: the problems, one line each.

    Raises:
        SystemExit: with status 2, when there is any problem.
    """
    problems = list(problems)
    if not problems:
        return
    parser.print_usage(sys.stderr)
    for problem in problems:
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
    raise SystemExit(2)


# --------------------------------------------------------------------------------------------------
# Writing: complete or not at all
# --------------------------------------------------------------------------------------------------


def _temporary(path: Path) -> Path:
    # Beside the target (the same file system, so the rename is atomic), hidden, with the target's
    # suffix last (matplotlib picks the format from it).
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


@contextmanager
def replacing(*paths: Path) -> Iterator[tuple[Path, ...]]:
    """Temporary files for ``paths``, renamed over them only when the block ends without an
    exception, all together (a results JSON never lands beside the plot of another run); on an
    exception they are removed and every old file
    stays as it was::

        with replacing(json_path, png_path) as (json_tmp, png_tmp):
            json_tmp.write_text(text)
            fig.savefig(png_tmp)

    Args:
        *paths: the files to replace.

    Yields:
        one temporary path per path, in the same folder.
    """
    paths = tuple(Path(p) for p in paths)
    temps = tuple(_temporary(p) for p in paths)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield temps
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


def _json_text(data) -> str:
    return json.dumps(data, indent=1) + "\n"


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file renamed over it: the old file stays until
    the new one is complete. Returns the path.

    Args:
        path: the file (its folder is created).
        text: the content.

    Returns:
        the path.
    """
    with replacing(path) as (tmp,):
        tmp.write_text(text)
    return Path(path)


def write_json(path: Path, data) -> Path:
    """``data`` as indented JSON, written like ``write_text``.

    Args:
        path: the file (its folder is created).
        data: anything JSON can write.

    Returns:
        the path.
    """
    return write_text(path, _json_text(data))


def save_figure(fig, path: Path, **savefig_kwargs) -> Path:
    """``fig.savefig`` through a temporary file renamed over ``path``.

    Args:
        fig: a matplotlib figure.
        path: the file (its folder is created).
        **savefig_kwargs: passed to ``fig.savefig``.

    Returns:
        the path.
    """
    with replacing(path) as (tmp,):
        fig.savefig(tmp, **savefig_kwargs)
    return Path(path)


def write_json_and_figure(json_path: Path, data, fig, png_path: Path, **savefig_kwargs) -> tuple[Path, Path]:
    """A results JSON and its plot, both replaced or neither (``replacing``).

    Args:
        json_path: the JSON file.
        data: anything JSON can write.
        fig: a matplotlib figure.
        png_path: the figure's file.
        **savefig_kwargs: passed to ``fig.savefig``.

    Returns:
        ``(json_path, png_path)``.
    """
    with replacing(json_path, png_path) as (json_tmp, png_tmp):
        json_tmp.write_text(_json_text(data))
        fig.savefig(png_tmp, **savefig_kwargs)
    return Path(json_path), Path(png_path)


__all__ = [
    "positive_int", "non_negative_int", "positive_float", "non_negative_float", "fraction", "positive_ints",
    "increasing_pair", "names", "runs_dir", "RUNS_ENV", "add_output_arguments", "output_root",
    "root_problems",
    "file_problems", "record_problems", "check_outputs", "fail", "replacing", "write_text",
    "write_json", "save_figure",
    "write_json_and_figure",
]
