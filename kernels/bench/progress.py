"""Progress bars that end as a line of text: ``progress_bar`` (tqdm in a terminal, a widget in a notebook).

A notebook's tqdm widget keeps, as its saved text form, the state it was first displayed in: a notebook executed
without a browser (nbmake, nbconvert) and saved shows ``0%|          | 0/30`` above the results of the finished
loop. Here the widget is displayed under a display id of its own, and closing the bar replaces that display with the
bar's final state as text, in a live notebook and in a saved one alike. In a terminal it is plain tqdm.
"""

from __future__ import annotations

from collections.abc import Iterable

from tqdm.auto import tqdm as _auto_tqdm
from tqdm.std import tqdm as _text_tqdm

try:
    from tqdm.notebook import tqdm as _widget_tqdm
except ImportError:  # no IPython: tqdm.auto is the terminal's tqdm, never the widget
    _widget_tqdm = None


def progress_bar(iterable: Iterable | None = None, **kwargs) -> _text_tqdm:
    """A tqdm progress bar over ``iterable`` (or updated by hand with ``total=``) that ends as one
    line of text.

    Args:
        iterable: what to iterate over, as ``tqdm(iterable)``; leave it out and call ``update`` with
            ``total=``.
        **kwargs: tqdm's arguments (``desc``, ``total``, ``disable``, ``leave``, ...).

    Returns:
        A tqdm bar: the terminal's, or in a notebook with ipywidgets a widget that ``close()`` (or the end of the
        iteration) replaces with its final state, e.g. ``rmsnorm: 100%|██████████| 30/30 [00:24<00:00]``. With
        ``leave=False`` the widget is replaced with nothing.
    """
    if _widget_tqdm is not None and issubclass(_auto_tqdm, _widget_tqdm):
        return _LineInTheEnd(iterable, **kwargs)
    return _auto_tqdm(iterable, **kwargs)


class _LineInTheEnd(_auto_tqdm):
    """tqdm.auto's notebook bar, shown under a display handle that ``close`` points at the final text."""

    def __init__(self, *args, **kwargs):
        kwargs["display"] = False
        super().__init__(*args, **kwargs)
        self._handle = None
        if not self.disable:
            from IPython.display import display

            self._handle = display(self.container, display_id=True)
            self.displayed = True

    def close(self):
        if self.disable or self._handle is None:
            return super().close()
        super().close()
        handle, self._handle = self._handle, None
        final = _text_tqdm.__str__(self) if self.leave else ""
        handle.update({"text/plain": final}, raw=True)
        # Nothing shows the widget any more: close it, so the kernel stops sending its updates.
        self.container.close()
