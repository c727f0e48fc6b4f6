"""How the exercise tests recognise a checker's diagnosis in its verdict: by the fixed words of its wording, the
fields a checker fills in (``{row}``, ``{got}``, …) left out."""

from __future__ import annotations

import re

_FIELD = re.compile(r"\{[^}]*\}")


def says(wording: str, message: str) -> bool:
    """Whether ``message`` holds the diagnosis worded ``wording``: every fixed piece of it, in order."""
    at = 0
    for piece in (p for p in _FIELD.split(wording) if p.strip()):
        at = message.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def sentence(wording: str) -> str:
    """The words that tell a diagnosis apart: the longest stretch of its wording between fields."""
    return max(_FIELD.split(wording), key=len)


def key_words(wording: str) -> str:
    """The words a verdict must contain to carry this diagnosis: the longest stretch of its wording between
    fields, up to its first colon (where that leaves 15 characters or more), at most 60 characters."""
    longest = sentence(wording)
    head = longest.split(":")[0]
    words = (head if len(head) >= 15 else longest)[:60]
    assert len(words.strip()) >= 10, f"{wording!r}: no words to look for"
    return words
