"""Check for the exercise of chapter 12: the global label count that every rank divides its loss by.

Under data parallelism each rank trains on its own rows, and its loss is its sum over the **global**
count of the labels the loss counts in the step (``num_items_in_batch``): then the ranks' shares add
up to one process's loss, and their summed gradients to one process's gradient. The reader writes

    global_label_count(ranks, rank) -> list[int]

where ``ranks[r][s]`` is the list of micro-batches rank ``r`` trains on at step ``s`` (dicts of
``input_ids``, ``attention_mask`` and ``labels``, each ``[rows, seq_len]``, labels ``-100`` on
prompts and padding), and the answer is, step by step, the count rank ``rank`` passes to the loss.
No process group is needed: the list of every rank's batches stands in for the ``all_reduce`` that
combines the ranks' counts in a real run (``kernels.distributed.parallel.global_label_counts``).

``check_global_label_count(fn)`` calls ``fn`` for every rank on batches made to tell the usual
mistakes apart (ranks with different amounts of padding, rows whose first label is trained, several
micro-batches per step) and names the mistake it recognises: averaging instead of summing across
ranks, each rank keeping its own count, counting ignore_index (-100) labels or padding, forgetting
the shift of a causal LM's loss, counting per micro-batch instead of per step. The reader's function
runs with the package's count out of reach (``reach.FORBIDDEN["global_label_count"]``:
``global_label_counts``, ``labels_per_step``, ``count_trained_labels``): calling one is refused by
name. Every diagnosis is worded once, in ``DIAGNOSES``. It never raises because the reader's
function is wrong or unfinished: it prints its verdict and returns a ``Report``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.training.data import IGNORE_INDEX
from kernels.training.loop import count_trained_labels, labels_per_step

from .reach import FinishedCodeCalled, call_learner, finished_answer, out_of_reach
from .rmsnorm import Report, last_line, verdict
from .sentences import sentence_lookup

# Every verdict, worded once. The mistakes of a wrong answer are joined with "; and ".
DIAGNOSES = {
    "stub": "not done yet: global_label_count still raises NotImplementedError",
    "raised": "your function raised {error} for rank {rank}",
    "not_a_list": ("your function returned {type} for rank {rank}; return a list with one count per step "
                   "(len(ranks[rank]) of them)"),
    "one_number": ("your function returned one number for rank {rank}: the loss needs one count "
                   "per optimizer step, a list of len(ranks[rank]) numbers"),
    "wrong_length": ("your function returned {got} numbers for rank {rank}, where there are "
                     "{steps} steps of {accum} micro-batches each: return one count per step"),
    "per_micro_batch": ("the labels were counted per micro-batch, not per step: with gradient "
                        "accumulation every micro-batch of a step divides its loss sum by the "
                        "count of the whole step (all its micro-batches), so that the step's "
                        "gradient is the mean over all of them"),
    "average": ("the ranks' counts were averaged instead of summed: each rank's loss is its share, "
                "sum_r / count_global, and the shares add up to the global mean only when "
                "count_global is the sum of the ranks' counts (an all_reduce with op SUM)"),
    "local": ("each rank divided by its own count: a rank with more padding then weighs more, and "
              "the shares no longer add up to one process's loss; combine the ranks' counts (sum "
              "them) so that every rank gets the same global count"),
    "ignore_index": ("the prompt's labels were counted: they are ignore_index (-100) like "
                     "padding's, and the loss skips them; count labels != -100, not the tokens the "
                     "attention mask lets through"),
    "padding": ("padding and prompt positions were counted (every position of a row, "
                "labels.numel() or rows × sequence length): their labels are -100 and the loss "
                "skips them; count labels != -100"),
    "no_shift": ("the shift was forgotten: a causal LM's loss compares the logits at position t "
                 "with the label at t + 1, so it counts labels[:, 1:] (the first label of a row is "
                 "never predicted); count labels[:, 1:] != -100"),
    "differs_by_rank": ("the ranks got different counts at step {step} ({counts}): every rank must "
                        "divide by the same global count, or the shares do not add up to one "
                        "process's loss"),
    "unrecognised": ("wrong count at step {step} for rank {rank}: {got} where the loss counts "
                     "{expected} labels over all ranks. Per rank and step: the labels[:, 1:] != "
                     "-100 of every micro-batch of the step; then the sum over the ranks"),
    "passed": ("global_label_count is right on {cases} set-ups ({shapes}): every rank gets, step "
               "by step, the sum over all ranks and micro-batches of the labels the loss counts, "
               "e.g. {example}"),
}


diagnosis = sentence_lookup(DIAGNOSES)


@dataclass(frozen=True)
class Case:
    """A simulated run: ``ranks`` processes, ``steps`` optimizer steps of ``accum`` micro-batches of
    ``rows`` rows of ``seq_len`` tokens on each rank."""

    ranks: int
    steps: int
    accum: int
    rows: int
    seq_len: int

    def __str__(self) -> str:
        return (f"{self.ranks} ranks × {self.steps} steps × {self.accum} micro-batches of "
                f"{self.rows} row(s) of up to {self.seq_len} tokens")


CASES = (Case(ranks=2, steps=3, accum=3, rows=2, seq_len=16),
         Case(ranks=3, steps=3, accum=2, rows=2, seq_len=16))


# --------------------------------------------------------------------------------------------------
# The batches
# --------------------------------------------------------------------------------------------------


def _row(seq_len: int, padding: int, first_trained: bool, gen: torch.Generator):
    """One row: ids, attention mask and labels. Real tokens are prompts (label -100) and responses
    (label = the token), in turns; ``padding`` positions at the end (attention 0, label -100). With
    ``first_trained`` the row starts inside a response, as a row cut from a long packed sequence
    does, so its first label is not -100."""
    ids = torch.randint(3, 1000, (seq_len,), generator=gen)
    mask = torch.ones(seq_len, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    real = seq_len - padding
    t, trained = 0, first_trained
    while t < real:
        span = int(torch.randint(1, 5, (1,), generator=gen))
        if trained:
            labels[t:min(t + span, real)] = ids[t:min(t + span, real)]
        t += span
        trained = not trained
    mask[real:] = 0
    return ids, mask, labels


def make_rank_batches(case: Case, gen: torch.Generator) -> list[list[list[dict]]]:
    """``ranks[r][s]``: the micro-batches of rank r at step s. Each micro-batch is padded to a
    length of its own (up to ``seq_len``), as a collator that pads to the longest row does; rank r's
    rows end with about r/4 of that length in padding, so the ranks' counts differ; about every
    other row starts with a trained label.

    Args:
        case: the set-up: how many ranks, steps, micro-batches per step, rows and tokens.
        gen: the random generator the tokens, lengths and label spans are drawn from.

    Returns:
        ``ranks[r][s]``, a list of ``case.accum`` micro-batches, each a dict of ``input_ids``,
        ``attention_mask`` and ``labels`` (int64, [rows, length]).
    """
    ranks = []
    for r in range(case.ranks):
        steps = []
        for _ in range(case.steps):
            micro = []
            for _ in range(case.accum):
                length = case.seq_len - int(torch.randint(0, case.seq_len // 4 + 1, (1,), generator=gen))
                rows = []
                for _ in range(case.rows):
                    extra = int(torch.randint(0, 3, (1,), generator=gen))
                    padding = min(length - 4, r * length // 4 + extra)
                    first = bool(torch.randint(0, 2, (1,), generator=gen))
                    rows.append(_row(length, padding, first, gen))
                ids, mask, labels = (torch.stack(parts) for parts in zip(*rows))
                micro.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
            steps.append(micro)
        ranks.append(steps)
    return ranks


# --------------------------------------------------------------------------------------------------
# The right answer, and the usual wrong ones
# --------------------------------------------------------------------------------------------------

# How one micro-batch's labels are counted: the right way, and the mistakes. A key names the
# choice's mistakes, joined by "+"; what follows a "/" only tells two variants of the same mistake
# apart.
_COUNTS: dict[str, Callable[[dict], int]] = {
    "right": count_trained_labels,  # labels[..., 1:] != -100: the package's own count
    "no_shift": lambda b: int((b["labels"] != IGNORE_INDEX).sum()),
    "ignore_index": lambda b: int(b["attention_mask"][:, 1:].sum()),
    "ignore_index+no_shift": lambda b: int(b["attention_mask"].sum()),
    "padding": lambda b: b["labels"][:, 1:].numel(),
    "padding+no_shift": lambda b: b["labels"].numel(),
}
# Which micro-batches of a step a count covers: all of them (right), or one (the first, or the last,
# as a loop that assigns instead of adding leaves it).
_STEPS: dict[str, Callable[[list[int]], int]] = {
    "right": sum,
    "per_micro_batch": lambda counts: counts[-1],
    "per_micro_batch/first": lambda counts: counts[0],
}
# How the ranks' counts are combined, for the rank that asks.
_COMBINE: dict[str, Callable[[list[int], int], float]] = {
    "right": lambda counts, rank: sum(counts),
    "average": lambda counts, rank: sum(counts) / len(counts),
    "average/floor": lambda counts, rank: sum(counts) // len(counts),
    "average/round": lambda counts, rank: round(sum(counts) / len(counts)),
    "local": lambda counts, rank: counts[rank],
}


RIGHT = ("right", "right", "right")


def _answers(ranks, count, step, combine) -> list[list[float]]:
    """Per rank, per step: what a function built from the three choices returns."""
    local = [[step([count(b) for b in micro]) for micro in steps] for steps in ranks]
    per_step = list(zip(*local))  # per step, every rank's count
    return [[combine(list(counts), rank) for counts in per_step] for rank in range(len(ranks))]


def expected_counts(ranks) -> list[int]:
    """Per step, the global count every rank passes to the loss: the training loop's own per-step
    counts (``labels_per_step``) of every rank, summed over the ranks.

    Args:
        ranks: ``ranks[r][s]``, rank r's micro-batches at step s, as ``make_rank_batches`` makes them.

    Returns:
        one count per step, the same for every rank.
    """
    return [sum(counts) for counts in zip(*(labels_per_step(steps) for steps in ranks))]


def _suspects(ranks) -> dict[tuple[str, str, str], list[list[float]]]:
    """Every combination of a counting, a step and a combining choice, keyed by the three choices' names."""
    return {(c, s, m): _answers(ranks, count, step, combine)
            for (c, count), (s, step), (m, combine)
            in itertools.product(_COUNTS.items(), _STEPS.items(), _COMBINE.items())}


def mistakes_of(choices: tuple[str, ...]) -> list[str]:
    """The diagnoses (keys of ``DIAGNOSES``) of a combination of choices; none for the right one.

    Args:
        choices: a counting, a step and a combining choice, by name (keys of ``_COUNTS``,
            ``_STEPS`` and ``_COMBINE``).

    Returns:
        the mistakes the names stand for, variants (after "/") dropped and "+" split apart.
    """
    return [part for name in choices if name != "right" for part in name.split("/")[0].split("+")]


def tells_mistakes_apart(ranks) -> bool:
    """Whether, on these batches, combinations of different mistakes always give different answers
    (else one could pass for another). Variants of the same mistakes (an average rounded down or
    not) may coincide.

    Args:
        ranks: ``ranks[r][s]``, as ``make_rank_batches`` makes them.

    Returns:
        True when no two different sets of mistakes give the same answers.
    """
    named: dict[tuple, frozenset] = {}
    for choices, answers in _suspects(ranks).items():
        key, mistakes = tuple(map(tuple, answers)), frozenset(mistakes_of(choices))
        if named.setdefault(key, mistakes) != mistakes:
            return False
    return True


def make_cases(gen: torch.Generator, tries: int = 50):
    """Batches for every case on which the mistakes can be told apart (random ones rarely fail; a
    few tries do).

    Args:
        gen: the random generator the batches are drawn from.
        tries: how many batches to draw for a case before keeping the last one as it is.

    Returns:
        ``(case, ranks)`` for each case of ``CASES``.
    """
    made = []
    for case in CASES:
        for _ in range(tries):
            ranks = make_rank_batches(case, gen)
            if tells_mistakes_apart(ranks):
                break
        made.append((case, ranks))
    return made


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------


def _numbers(out, rank: int, case: Case) -> tuple[list[float] | None, str | None]:
    """The reader's answer as a list of floats, or what is wrong with its form."""
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return None, diagnosis("one_number", rank=rank)
    if not isinstance(out, (list, tuple)):
        return None, diagnosis("not_a_list", type=type(out).__name__, rank=rank)
    try:
        values = [float(v.item() if isinstance(v, torch.Tensor) else v) for v in out]
    except (TypeError, ValueError):
        return None, diagnosis("not_a_list", type=(f"a {type(out).__name__} of "
                                                   f"{type(out[0]).__name__}"), rank=rank)
    if len(values) == case.steps * case.accum and case.accum > 1:
        return None, diagnosis("per_micro_batch")
    if len(values) != case.steps:
        return None, diagnosis("wrong_length", got=len(values), rank=rank, steps=case.steps,
                               accum=case.accum)
    return values, None


def _same(got: list[list[float]], want: list[list[float]]) -> bool:
    """Whether two answers (per rank, per step) hold the same numbers."""
    return all(math.isclose(a, b, abs_tol=1e-9) for got_rank, want_rank in zip(got, want)
               for a, b in zip(got_rank, want_rank))


class _Refused(Exception):
    """The reader's function called a finished answer: the message is the verdict, said without the
    set-up."""


def _check_case(fn, case: Case, ranks, exercise: str | None = "global_label_count") -> str | None:
    """What is wrong with ``fn``'s answers on one set-up, or None; ``fn`` runs with ``exercise``'s
    finished answers out of reach (``exercise`` None: ``fn`` is the check's own, replaying answers
    already given)."""
    got = []
    for rank in range(case.ranks):
        try:
            out = fn(ranks, rank) if exercise is None else call_learner(exercise, fn, ranks, rank)
        except FinishedCodeCalled as called:
            raise _Refused(str(called)) from None
        except NotImplementedError:
            return diagnosis("stub")
        except Exception as error:  # noqa: BLE001  (any failure of the reader's code is reported, not raised)
            return diagnosis("raised", error=f"{type(error).__name__}: {last_line(error)}", rank=rank)
        values, problem = _numbers(out, rank, case)
        if problem is not None:
            return problem
        got.append(values)
    suspects = _suspects(ranks)
    if _same(got, suspects[RIGHT]):
        return None
    matches = [mistakes_of(choices) for choices, answers in suspects.items() if _same(got, answers)]
    if matches:  # one set of mistakes (the batches are made so), perhaps by several variants
        return "; and ".join(DIAGNOSES[m] for m in dict.fromkeys(matches[0]))
    want = expected_counts(ranks)
    for step in range(case.steps):
        counts = [got[rank][step] for rank in range(case.ranks)]
        if len(set(counts)) > 1:
            return diagnosis("differs_by_rank", step=step, counts=", ".join(f"rank {r}: {c:g}"
                                                                             for r, c in enumerate(counts)))
    step = next(s for s in range(case.steps) if not math.isclose(got[0][s], want[s]))
    return diagnosis("unrecognised", step=step, rank=0, got=f"{got[0][step]:g}", expected=want[step])


def check_global_label_count(fn: Callable, seed: int | None = None, verbose: bool = True) -> Report:
    """Check ``fn(ranks, rank) -> list`` (the count rank ``rank`` passes to the loss at each step,
    ``ranks[r][s]`` being rank r's micro-batches of step s) against the sum over ranks and
    micro-batches of ``kernels.training.loop.count_trained_labels``, on every case. Prints the
    verdict (unless ``verbose=False``) and returns it; never raises because ``fn`` is wrong or
    unfinished (chapter 12, notebooks/12_multi_gpu.ipynb).

    Args:
        fn: the reader's ``global_label_count(ranks, rank) -> list``: ``ranks[r][s]`` lists rank r's
            micro-batches at step s (dicts of ``input_ids``, ``attention_mask`` and ``labels``,
            [rows, seq_len], labels -100 where not trained); the answer holds one count per step.
        seed: seed of the random batches; None draws fresh ones.
        verbose: print the verdict: ✓ with an example of a right count, or ✗ with the set-up and
            the mistake recognised.

    Returns:
        a ``Report``: ``passed``, and the verdict's message.
    """
    gen = torch.Generator()
    gen.manual_seed(seed) if seed is not None else gen.seed()  # fresh batches unless a seed replays some
    example = None
    for case, ranks in make_cases(gen):
        try:
            problem = _check_case(fn, case, ranks)
        except _Refused as called:
            return verdict(False, str(called), verbose)
        if problem is not None:  # named with the set-up it showed on, unless the function is not written yet
            return verdict(False, problem if problem == DIAGNOSES["stub"] else f"{case}: {problem}", verbose)
        if example is None:
            local = [labels_per_step(steps)[0] for steps in ranks]
            example = (f"step 0 of {case.ranks} ranks: {' + '.join(map(str, local))} = "
                       f"{expected_counts(ranks)[0]}")
    shapes = "; ".join(str(case) for case in CASES)
    return verdict(True, diagnosis("passed", cases=len(CASES), shapes=shapes, example=example), verbose)


# ==================================================================================================
# The same count through a collective: the reader's function runs once per rank, as each process
# would
# ==================================================================================================
#
# ``fn(steps, all_reduce) -> list`` gets only its own rank's step groups and an
# ``all_reduce(tensor)`` that sums ``tensor`` in place over the ranks, as
# ``torch.distributed.all_reduce(tensor, op=ReduceOp.SUM)`` does. The check runs one thread per
# rank, each calling ``fn`` (a collective waits until every rank has joined it, so the threads meet
# inside ``all_reduce``), then names the answer's mistakes as above, and the collective's own: ranks
# that call it a different number of times (a real run hangs), something else than a tensor, ranks
# that hand it tensors of different shapes, and more than one collective per rank (each is a round
# trip between the GPUs).

COLLECTIVE_DIAGNOSES = {
    "stub": "not done yet: global_label_count still raises NotImplementedError",
    "hang": ("rank {rank} called all_reduce {more} time(s) while rank {other} called it {fewer}: a "
             "collective waits for every rank, so a real run would hang there. Every rank must "
             "make the same calls, in the same order, whatever its data"),
    "not_tensor": ("all_reduce was given {type}: a collective sums a tensor in place (every rank's "
                   "copy becomes the sum), so put the counts in a tensor, all_reduce it, then read "
                   "it back"),
    "shapes": ("the ranks handed all_reduce tensors of different shapes ({shapes}): every rank "
               "must contribute a tensor of the same shape, one element per step"),
    "several": ("the counts are right, but each rank called all_reduce {calls} times: every "
                "collective is a round trip between the GPUs (and, read with .item() or .tolist(), "
                "a wait for it). Put every step's count in one tensor and all_reduce it once"),
    "none": ("no rank called all_reduce: each rank sees only its own batches, so without the "
             "collective it can only count its own labels"),
}
COLLECTIVE_TIMEOUT_S = 20.0  # a rank waiting this long at a collective is taken for a hang


class _Hang(RuntimeError):
    """A rank waited at a collective that some other rank will never join."""


class _Collective:
    """``all_reduce`` for ``world`` threads, one per rank: each call waits until every rank has
    contributed, then every rank's tensor becomes the sum. Counts the calls; a rank still waiting
    when another has finished (or has failed) is released with ``_Hang``, where a real run would
    wait forever."""

    def __init__(self, world: int):
        import threading

        self.world = world
        self.cond = threading.Condition()
        self.arrived, self.generation = 0, 0
        self.done: set[int] = set()  # ranks whose function has returned or raised
        self.local = threading.local()
        self.slots: list = [None] * world
        self.calls = [0] * world
        self.problem: str | None = None

    def _meet(self) -> None:
        """Wait until every rank has arrived here (a generation of the rendezvous)."""
        with self.cond:
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.world:
                self.arrived, self.generation = 0, generation + 1
                self.cond.notify_all()
                return
            while self.generation == generation:
                if self.done or self.problem:
                    raise _Hang("a rank waits at a collective no other rank will join")
                if not self.cond.wait(COLLECTIVE_TIMEOUT_S):
                    raise _Hang("a rank waited at a collective longer than the check allows")

    def __call__(self, tensor, op=None, group=None, async_op=False):
        rank = self.local.rank
        if not isinstance(tensor, torch.Tensor):
            with self.cond:
                self.problem = self.problem or diagnosis_collective("not_tensor", type=type(tensor).__name__)
                self.cond.notify_all()
            raise TypeError(self.problem)
        self.calls[rank] += 1
        self.slots[rank] = tensor.detach().clone()
        self._meet()  # every rank has contributed
        shapes = {tuple(s.shape) for s in self.slots}
        if len(shapes) > 1:
            with self.cond:
                self.problem = self.problem or diagnosis_collective(
                    "shapes",
                    shapes=", ".join(f"rank {r}: {tuple(s.shape)}" for r, s in enumerate(self.slots)))
                self.cond.notify_all()
            raise RuntimeError(self.problem)
        total = torch.stack([s.to(torch.float64) for s in self.slots]).sum(0)
        self._meet()  # every rank has read the contributions
        tensor.copy_(total.to(tensor.dtype))

    def run(self, fn, ranks) -> tuple[list, list]:
        """``fn(ranks[r], self)`` on one thread per rank: the answers and the exceptions, by rank."""
        import threading

        answers, errors = [None] * self.world, [None] * self.world

        def target(rank):
            self.local.rank = rank
            try:
                answers[rank] = fn(ranks[rank], self)
            except BaseException as error:  # noqa: BLE001  (reported by rank, never raised from a thread)
                errors[rank] = error
            finally:
                with self.cond:
                    self.done.add(rank)
                    # a rank still waiting at a collective would wait forever: release it
                    self.cond.notify_all()

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * COLLECTIVE_TIMEOUT_S)
        return answers, errors


def diagnosis_collective(key: str, **fields) -> str:
    """The sentence ``COLLECTIVE_DIAGNOSES[key]`` with its fields filled in.

    Args:
        key: a key of ``COLLECTIVE_DIAGNOSES``.
        **fields: the sentence's fields.

    Returns:
        the sentence.

    Raises:
        KeyError: when ``key`` is unknown or a field the sentence names is missing.
    """
    return COLLECTIVE_DIAGNOSES[key].format(**fields)


COLLECTIVE_EXERCISE = "global_label_count_collective"


def _collective_case(fn, case: Case, ranks) -> str | None:
    collective = _Collective(case.ranks)
    # One tripwire for every rank's thread: the ranks run the reader's function at the same time.
    with out_of_reach(COLLECTIVE_EXERCISE, fn) as tripwire:
        answers, errors = collective.run(fn, ranks)
    if tripwire.called:
        raise _Refused(tripwire.message)
    if any(isinstance(e, NotImplementedError) for e in errors):
        return diagnosis_collective("stub")
    if collective.problem:
        return collective.problem
    calls = collective.calls
    if len(set(calls)) > 1:
        more = max(range(case.ranks), key=lambda r: calls[r])
        fewer = min(range(case.ranks), key=lambda r: calls[r])
        return diagnosis_collective("hang", rank=more, more=calls[more], other=fewer, fewer=calls[fewer])
    for rank, error in enumerate(errors):
        if error is not None:
            return diagnosis("raised", error=f"{type(error).__name__}: {last_line(error)}", rank=rank)
    problem = _check_case(lambda _ranks, rank: answers[rank], case, ranks, exercise=None)
    if problem is not None:
        if calls[0] == 0 and problem.startswith(DIAGNOSES["local"][:40]):
            return diagnosis_collective("none")
        return problem
    if calls[0] > 1:
        return diagnosis_collective("several", calls=calls[0])
    return None


def check_global_label_count_collective(fn: Callable, seed: int | None = None,
                                        verbose: bool = True) -> Report:
    """Check ``fn(steps, all_reduce) -> list``, run once per rank on that rank's step groups with a
    summing ``all_reduce`` shared by the ranks (see the notes above ``COLLECTIVE_DIAGNOSES``).
    Prints the verdict (unless ``verbose=False``) and returns it; never raises because ``fn`` is
    wrong or unfinished (chapter 12, notebooks/12_multi_gpu.ipynb).

    Args:
        fn: the reader's ``global_label_count(steps, all_reduce) -> list``: ``steps[s]`` lists the
            rank's own micro-batches at step s, and ``all_reduce(tensor)`` sums ``tensor`` in place
            over the ranks, as ``torch.distributed.all_reduce`` does; the answer holds one count
            per step.
        seed: seed of the random batches; None draws fresh ones.
        verbose: print the verdict: ✓, or ✗ with the set-up and the mistake recognised (in the
            count, or in the use of the collective: a hang, not a tensor, different shapes, several
            calls, none).

    Returns:
        a ``Report``: ``passed``, and the verdict's message.
    """
    refused = finished_answer(COLLECTIVE_EXERCISE, fn)
    if refused is not None:
        return verdict(False, refused, verbose)
    gen = torch.Generator()
    gen.manual_seed(seed) if seed is not None else gen.seed()
    example = None
    for case, ranks in make_cases(gen):
        try:
            problem = _collective_case(fn, case, ranks)
        except _Refused as called:
            return verdict(False, str(called), verbose)
        if problem is not None:
            stub = problem == COLLECTIVE_DIAGNOSES["stub"]
            return verdict(False, problem if stub else f"{case}: {problem}", verbose)
        if example is None:
            local = [labels_per_step(steps)[0] for steps in ranks]
            example = (f"step 0 of {case.ranks} ranks: {' + '.join(map(str, local))} = "
                       f"{expected_counts(ranks)[0]}")
    shapes = "; ".join(str(case) for case in CASES)
    return verdict(True, diagnosis("passed", cases=len(CASES), shapes=shapes, example=example)
                   + " One all_reduce per rank, the same on every rank.", verbose)
