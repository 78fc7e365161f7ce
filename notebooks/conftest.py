"""pytest for the notebooks: 03 and 04 run Triton kernels, so they are skipped, with the reason
shown, where Triton is not installed (it publishes wheels for Linux only).

The stored outputs come from a CPU run (float32, token-exact with HF transformers). On a machine with a GPU the
kernels that nbval starts get NANOREF_DEVICE=cpu, so an `LLM(...)` made without `device=` runs there as it did
when the outputs were stored; the cells that use the GPU on purpose (Triton kernels, CUDA graphs) name it
themselves and mark or sanitize what differs."""

from __future__ import annotations

import importlib.util
import os

import pytest

TRITON_NOTEBOOKS = ("03_triton_kv_store.ipynb", "04_paged_decode_attention.ipynb")


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("triton") is not None:
        return
    skip = pytest.mark.skip(reason="Triton is not installed (Linux wheels only): the Triton notebooks cannot run")
    for item in items:
        if item.path.name in TRITON_NOTEBOOKS:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel while setting up its first cell: give that kernel NANOREF_DEVICE=cpu, and
    leave this process's environment as it was (the GPU tests in tests/ keep their default device)."""
    before = os.environ.get("NANOREF_DEVICE")
    os.environ["NANOREF_DEVICE"] = "cpu"
    try:
        yield
    finally:
        if before is None:
            del os.environ["NANOREF_DEVICE"]
        else:
            os.environ["NANOREF_DEVICE"] = before
