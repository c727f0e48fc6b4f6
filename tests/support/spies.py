"""Counting the calls a patched model makes through a module's function, for the patch tests."""

from __future__ import annotations


def count_calls(monkeypatch, counts: dict[str, int], module, name: str, key: str) -> None:
    """Replace ``module.name`` (for the test) by a wrapper that adds one to ``counts[key]`` per call
    and then calls the original."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
