"""pytest for the notebooks: 03 and 04 run Triton kernels, so they are skipped, with the reason
shown, where Triton is not installed (it publishes wheels for Linux only).

The stored outputs come from a CPU run (float32, token-exact with HF transformers). On a machine with a GPU the
kernels that nbval starts get NANOREF_DEVICE=cpu, so an `LLM(...)` made without `device=` runs on the CPU in
float32, as when the outputs were stored. nanoref's Triton kernels compile for the GPU there, so the cells that run
them put their tensors and engines where the kernels run (`kernel_device()`); the cells that use the GPU on purpose
(CUDA graphs) name it themselves and mark what differs. PYDEVD_DISABLE_FILE_VALIDATION=1 keeps the kernel's debugger
from printing its frozen-modules notice into the first cell's output on some Python builds."""

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


KERNEL_ENV = {"NANOREF_DEVICE": "cpu", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel while setting up its first cell: give that kernel KERNEL_ENV, and leave this
    process's environment as it was (the GPU tests in tests/ keep their default device and compiled kernels)."""
    before = {name: os.environ.get(name) for name in KERNEL_ENV}
    os.environ.update(KERNEL_ENV)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
