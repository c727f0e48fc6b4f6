"""Chapter 12's exercise, one answer: the global label count, computed on each rank and summed by
one all_reduce."""

import torch


def global_label_count_collective(steps, all_reduce):
    # This rank's count per optimizer step: over all the micro-batches of the step, the labels after
    # the shift a causal LM's loss applies (position t predicts the label at t + 1, so
    # labels[:, 1:]) that are not ignore_index (-100: prompts and padding).
    counts = torch.tensor([sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in micro)
                           for micro in steps])
    # One collective for every step at once: afterwards each rank's tensor holds the sum over the
    # ranks, the same on every rank, so that the ranks' shares (sum_r / global count) add up to one
    # process's loss.
    all_reduce(counts)
    return counts.tolist()
