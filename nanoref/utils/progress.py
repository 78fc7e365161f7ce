"""The progress bar `generate` shows: tqdm's notebook widget in Jupyter where ipywidgets is installed, else its
text bar.

`tqdm.auto` picks the widget inside a notebook, but when ipywidgets is missing it warns ("IProgress not found") on
import, into the output of whichever cell first imports nanoref. So it is chosen only where the widget can work.

Two things tqdm does to the process by default are left out here, since a bar made by the library must leave the
caller's process as it found it: its first bar makes tqdm's multiprocessing lock from the default context, which
fixes the start method (the caller's `multiprocessing.set_start_method` then fails: "context has already been
set"); and every bar starts a monitor thread that runs until the process ends.
"""

from __future__ import annotations

import importlib.util
import multiprocessing


def _widgets_installed() -> bool:
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except ValueError:  # sys.modules["ipywidgets"] is None: imports of it are blocked
        return False


if _widgets_installed():
    from tqdm.auto import tqdm as _tqdm
else:
    from tqdm.std import tqdm as _tqdm


def _make_tqdm_lock() -> None:
    """tqdm's lock across processes, made as tqdm makes it (a multiprocessing RLock of the start method in force,
    else of the default one), but from a context named explicitly: the default context stays unfixed."""
    from tqdm.std import TqdmDefaultWriteLock

    if hasattr(TqdmDefaultWriteLock, "mp_lock"):
        return
    method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    try:
        TqdmDefaultWriteLock.mp_lock = multiprocessing.get_context(method).RLock()
    except (ImportError, OSError):  # (as tqdm: no lock across processes where the platform has none)
        TqdmDefaultWriteLock.mp_lock = None


class tqdm(_tqdm):  # noqa: N801 (tqdm's name)
    monitor_interval = 0  # no monitor thread (it would outlive the bar, and the call)

    def __new__(cls, *args, **kwargs):
        _make_tqdm_lock()
        return super().__new__(cls, *args, **kwargs)


__all__ = ["tqdm"]
