"""pytest for the notebooks: 03 and 04 run Triton kernels, so they are skipped, with the reason
shown, where Triton is not installed (it publishes wheels for Linux only)."""

from __future__ import annotations

import importlib.util

import pytest

TRITON_NOTEBOOKS = ("03_triton_kv_store.ipynb", "04_paged_decode_attention.ipynb")


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("triton") is not None:
        return
    skip = pytest.mark.skip(reason="Triton is not installed (Linux wheels only): the Triton notebooks cannot run")
    for item in items:
        if item.path.name in TRITON_NOTEBOOKS:
            item.add_marker(skip)
