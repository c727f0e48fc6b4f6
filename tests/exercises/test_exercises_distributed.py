"""The chapter 12 exercise check: the solution passes, and every usual mistake of the global label count is named with
the sentence of ``DIAGNOSES``, without raising."""

import pytest
import torch

from kernels.distributed.parallel import global_label_counts
from kernels.exercises import solutions
from kernels.exercises.distributed import (
    CASES,
    DIAGNOSES,
    check_global_label_count,
    expected_counts,
    make_cases,
    make_rank_batches,
    tells_mistakes_apart,
)
from kernels.exercises.solutions import load
from kernels.training.loop import labels_per_step


def trained(batch, shift=True):
    labels = batch["labels"][:, 1:] if shift else batch["labels"]
    return int((labels != -100).sum())


def local_counts(ranks, count=trained):
    return [[sum(count(b) for b in micro) for micro in steps] for steps in ranks]


def summed(local):
    return [sum(c) for c in zip(*local)]


def stub(ranks, rank):
    raise NotImplementedError("your turn")


def raises(ranks, rank):
    return ranks[rank][0][0]["lables"]


def per_micro_batch_list(ranks, rank):  # one count per micro-batch, summed over the ranks
    return [sum(c) for c in zip(*[[trained(b) for micro in steps for b in micro] for steps in ranks])]


def per_micro_batch_last(ranks, rank):  # the step's loop assigns instead of adding: the last micro-batch's count
    local = []
    for steps in ranks:
        counts = []
        for micro in steps:
            for batch in micro:
                count = trained(batch)
            counts.append(count)
        local.append(counts)
    return summed(local)


WRONG = {
    # name: (function, the diagnoses its message must hold)
    "stub": (stub, ["stub"]),
    "raised": (raises, ["raised"]),
    "not_a_list": (lambda ranks, rank: {"counts": summed(local_counts(ranks))}, ["not_a_list"]),
    "one_number": (lambda ranks, rank: sum(summed(local_counts(ranks))), ["one_number"]),
    "per_rank_not_per_step": (lambda ranks, rank: [sum(r) for r in local_counts(ranks)], ["wrong_length"]),
    "per_micro_batch_list": (per_micro_batch_list, ["per_micro_batch"]),
    "per_micro_batch_last": (per_micro_batch_last, ["per_micro_batch"]),
    "average": (lambda ranks, rank: [sum(c) / len(c) for c in zip(*local_counts(ranks))], ["average"]),
    "average_floor": (lambda ranks, rank: [sum(c) // len(c) for c in zip(*local_counts(ranks))], ["average"]),
    "local": (lambda ranks, rank: local_counts(ranks)[rank], ["local"]),
    "ignore_index": (lambda ranks, rank: summed(local_counts(ranks, lambda b: int(b["attention_mask"][:, 1:].sum()))),
                     ["ignore_index"]),
    "padding": (lambda ranks, rank: summed(local_counts(ranks, lambda b: b["labels"][:, 1:].numel())), ["padding"]),
    "no_shift": (lambda ranks, rank: summed(local_counts(ranks, lambda b: trained(b, shift=False))), ["no_shift"]),
    "no_shift_and_local": (lambda ranks, rank: local_counts(ranks, lambda b: trained(b, shift=False))[rank],
                           ["no_shift", "local"]),
    "differs_by_rank": (lambda ranks, rank: [c + rank for c in summed(local_counts(ranks))], ["differs_by_rank"]),
    "unrecognised": (lambda ranks, rank: [c + 1 for c in summed(local_counts(ranks))], ["unrecognised"]),
}


def head(key):
    """The fixed start of a diagnosis, up to its first field."""
    return DIAGNOSES[key].split("{")[0]


@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_mistake_is_named(name, seed):
    fn, keys = WRONG[name]
    report = check_global_label_count(fn, seed=seed, verbose=False)
    assert not report
    for key in keys:
        assert head(key) in report.message, report.message


def test_every_diagnosis_has_a_test():
    assert {key for _, keys in WRONG.values() for key in keys} | {"passed"} == set(DIAGNOSES)


def test_the_solution_passes(seed, capsys):
    assert "global_label_count" in solutions.names()
    assert check_global_label_count(load("global_label_count"), seed=seed)
    out = capsys.readouterr().out
    assert out.startswith("✓ " + head("passed")) and "✗" not in out


def test_a_tensor_answer_is_read_as_numbers(seed):
    solution = load("global_label_count")

    def as_tensor(ranks, rank):
        return torch.tensor(solution(ranks, rank))

    assert check_global_label_count(as_tensor, seed=seed, verbose=False)


def test_the_reference_is_the_packages_count(gen):
    # The check's right answer is what the training loop passes: the sum over ranks of labels_per_step, which is
    # what kernels.distributed.parallel.global_label_counts all-reduces (without a process group, its local counts).
    for case in CASES:
        ranks = make_rank_batches(case, gen)
        assert expected_counts(ranks) == summed([labels_per_step(steps) for steps in ranks])
        assert global_label_counts(ranks[0], torch.device("cpu")) == labels_per_step(ranks[0])


def test_the_batches_tell_every_mistake_apart(gen):
    for case, ranks in make_cases(gen):
        assert tells_mistakes_apart(ranks), case
        for steps in ranks:
            assert len(steps) == case.steps and all(len(micro) == case.accum for micro in steps)
        first_labels = torch.cat([b["labels"][:, 0] for steps in ranks for micro in steps for b in micro])
        assert (first_labels != -100).any(), "no row starts with a trained label: the shift would not matter"


def test_a_quiet_check_prints_nothing(capsys):
    assert not check_global_label_count(stub, verbose=False)
    assert capsys.readouterr().out == ""


# --------------------------------------------------------------------------------------------------------------------
# The same count through a collective, one thread per rank
# --------------------------------------------------------------------------------------------------------------------

import diagnoses as _diagnoses  # noqa: E402

from kernels.exercises.distributed import (  # noqa: E402
    COLLECTIVE_DIAGNOSES,
    check_global_label_count_collective,
)


def _step_counts(steps, shift=True):
    cut = slice(1, None) if shift else slice(None)
    return [sum(int((b["labels"][:, cut] != -100).sum()) for b in micro) for micro in steps]


def collective_right(steps, all_reduce):
    counts = torch.tensor(_step_counts(steps))
    all_reduce(counts)
    return counts.tolist()


def collective_none(steps, all_reduce):
    return _step_counts(steps)


def collective_per_step(steps, all_reduce):
    out = []
    for count in _step_counts(steps):
        t = torch.tensor(count)
        all_reduce(t)
        out.append(int(t.item()))
    return out


def collective_int(steps, all_reduce):
    counts = _step_counts(steps)
    all_reduce(counts)
    return counts


def collective_conditional(steps, all_reduce):
    # Only the ranks with labels in their first micro-batch of step 0 join a second collective: the others do not.
    counts = torch.tensor(_step_counts(steps))
    all_reduce(counts)
    if int((steps[0][0]["labels"] != -100).sum()) % 2:
        all_reduce(torch.zeros_like(counts))
    return counts.tolist()


def collective_own_shapes(steps, all_reduce):
    counts = torch.tensor(_step_counts(steps) + [0] * (len(steps[0][0]["labels"]) % 2 + int(len(steps) > 0)))
    counts = counts[: len(steps) + (1 if steps[0][0]["labels"][0, -1] == -100 else 0)]
    all_reduce(counts)
    return counts.tolist()[: len(steps)]


def collective_stub(steps, all_reduce):
    raise NotImplementedError


def test_the_collective_solution_and_a_plain_version_pass():
    assert check_global_label_count_collective(load("global_label_count_collective"), seed=0, verbose=False)
    assert check_global_label_count_collective(collective_right, seed=1, verbose=False)


@pytest.mark.parametrize("fn, key", [
    (collective_none, "none"),
    (collective_per_step, "several"),
    (collective_int, "not_tensor"),
    (collective_stub, "stub"),
])
def test_each_collective_mistake_is_named(fn, key):
    report = check_global_label_count_collective(fn, seed=0, verbose=False)
    assert not report
    assert _diagnoses.says(COLLECTIVE_DIAGNOSES[key], report.message), report.message


@pytest.mark.parametrize("mistake, key, what", [
    (collective_conditional, "hang", "made the ranks' calls differ"),  # some rank takes the extra call, another not
    (collective_own_shapes, "shapes", "gave the ranks different shapes"),
], ids=["unequal-calls-named-not-hung", "shapes-differ-by-rank"])
def test_a_collective_the_ranks_do_not_share_is_named(mistake, key, what):
    # Seeds until the batches make the ranks differ.
    for seed in range(20):
        report = check_global_label_count_collective(mistake, seed=seed, verbose=False)
        if not report and _diagnoses.says(COLLECTIVE_DIAGNOSES[key], report.message):
            return
    pytest.fail(f"no seed {what}: {report.message}")


def collective_per_micro_batch(steps, all_reduce):
    counts = torch.tensor([int((b["labels"][:, 1:] != -100).sum()) for micro in steps for b in micro])
    all_reduce(counts)
    return counts.tolist()


def collective_padding(steps, all_reduce):
    counts = torch.tensor([sum(b["labels"][:, 1:].numel() for b in micro) for micro in steps])
    all_reduce(counts)
    return counts.tolist()


def collective_attention_mask(steps, all_reduce):
    # The tokens the attention mask lets through, prompts included.
    counts = torch.tensor([sum(int(b["attention_mask"][:, 1:].sum()) for b in micro) for micro in steps])
    all_reduce(counts)
    return counts.tolist()


@pytest.mark.parametrize("fn, key", [
    (collective_per_micro_batch, "per_micro_batch"),
    (collective_padding, "padding"),
    (collective_attention_mask, "ignore_index"),
])
def test_the_counting_mistakes_are_named_through_the_collective(fn, key):
    report = check_global_label_count_collective(fn, seed=0, verbose=False)
    assert not report and _diagnoses.says(DIAGNOSES[key], report.message), report.message


def collective_by_the_package(steps, all_reduce):
    # The chapter's own helper, printed in section 4: without a process group it returns this rank's counts.
    return global_label_counts(steps, torch.device("cpu"))


def collective_by_labels_per_step(steps, all_reduce):
    counts = torch.tensor(labels_per_step(steps))
    all_reduce(counts)
    return counts.tolist()


def collective_by_count_trained_labels(steps, all_reduce):
    from kernels.training.loop import count_trained_labels

    counts = torch.tensor([sum(count_trained_labels(b) for b in micro) for micro in steps])
    all_reduce(counts)
    return counts.tolist()


def collective_by_the_package_caught(steps, all_reduce):
    try:
        return collective_by_labels_per_step(steps, all_reduce)
    except Exception:  # noqa: BLE001  (a learner hiding the refusal: still refused)
        return collective_right(steps, all_reduce)


@pytest.mark.parametrize("fn, name", [
    (global_label_counts, "global_label_counts"),  # handed to the check itself
    (collective_by_the_package, "global_label_counts"),
    (collective_by_labels_per_step, "labels_per_step"),
    (collective_by_count_trained_labels, "count_trained_labels"),
    (collective_by_the_package_caught, "labels_per_step"),
])
def test_the_package_count_is_refused_by_name_in_the_collective(fn, name):
    report = check_global_label_count_collective(fn, seed=0, verbose=False)
    assert not report and name in report.message and "finished answer" in report.message, report.message
    assert labels_per_step([[{"labels": torch.tensor([[-100, 1, 2]])}]]) == [2]  # put back afterwards


@pytest.mark.parametrize("fn, name", [
    (lambda ranks, rank: [sum(c) for c in zip(*[labels_per_step(s) for s in ranks])], "labels_per_step"),
    (lambda ranks, rank: expected_counts(ranks), "expected_counts"),
    (lambda ranks, rank: global_label_counts(ranks[rank], torch.device("cpu")), "global_label_counts"),
])
def test_the_package_count_is_refused_by_name(fn, name):
    report = check_global_label_count(fn, seed=0, verbose=False)
    assert not report and name in report.message and "finished answer" in report.message, report.message


def test_the_answer_mistakes_are_still_named_through_the_collective():
    def no_shift(steps, all_reduce):
        counts = torch.tensor(_step_counts(steps, shift=False))
        all_reduce(counts)
        return counts.tolist()

    report = check_global_label_count_collective(no_shift, seed=0, verbose=False)
    assert not report and _diagnoses.says(DIAGNOSES["no_shift"], report.message), report.message
