"""The checks' sentences: each exercise module keeps its diagnoses as a table of sentences with
fields in braces, and one function fills a sentence in."""

from __future__ import annotations

from collections.abc import Callable


def sentence_lookup(table: dict[str, str]) -> Callable[..., str]:
    """The function that fills in one sentence of ``table`` (an exercise module's ``hint`` or
    ``diagnosis``).

    Args:
        table: the module's sentences by key, with fields in braces.

    Returns:
        ``lookup(key, **fields)``: the sentence ``table[key]`` with its fields filled in, as the
        check prints it; a KeyError for a key not in ``table`` or a field not given.
    """
    def lookup(key: str, **fields) -> str:
        return table[key].format(**fields)

    return lookup
