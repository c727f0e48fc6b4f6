"""Chapter 12's exercise, one answer: the global label count every rank divides its loss sum by,
step by step."""


def global_label_count(ranks, rank):
    # This rank's count, and every other rank's, per optimizer step: over all the micro-batches of
    # the step, the labels after the shift a causal LM's loss applies (position t predicts the label
    # at t + 1, so labels[:, 1:]) that are not ignore_index (-100: prompts and padding).
    def step_count(micro_batches):
        return sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in micro_batches)

    # local[r][s]: rank r's count at step s
    local = [[step_count(step) for step in steps] for steps in ranks]
    # What all_reduce(SUM) gives every rank: per step, the sum of the ranks' counts. It is the same
    # list whichever rank asks, so that the ranks' shares (sum_r / global count) add up to one
    # process's loss.
    return [sum(counts) for counts in zip(*local)]
