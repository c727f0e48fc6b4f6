"""Chapter 01's exercise, one answer: Amdahl's law for a part of a step made faster."""


def amdahl_speedup(share, factor):
    """How many times faster a whole step runs when a part taking ``share`` of its time (a fraction,
    0 to 1) runs ``factor`` times faster."""
    # The rest of the step, 1 - share, takes as long as before; the part shrinks to share / factor.
    # The speed-up is the old time (1) over the new one. As factor grows, share / factor goes to 0:
    # the bound 1 / (1 - share).
    return 1.0 / ((1.0 - share) + share / factor)
