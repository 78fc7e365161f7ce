"""The progress bar `generate` shows: tqdm's notebook widget in Jupyter where ipywidgets is installed, else its
text bar.

`tqdm.auto` picks the widget inside a notebook, but when ipywidgets is missing it warns ("IProgress not found") on
import, into the output of whichever cell first imports nanoref. So it is chosen only where the widget can work.
"""

from __future__ import annotations

import importlib.util


def _widgets_installed() -> bool:
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except ValueError:  # sys.modules["ipywidgets"] is None: imports of it are blocked
        return False


if _widgets_installed():
    from tqdm.auto import tqdm
else:
    from tqdm.std import tqdm

__all__ = ["tqdm"]
