"""pytest for the notebooks: a notebook whose cells need an optional package is skipped, naming it, where that is not
installed (`nanoref.testing.NOTEBOOK_NEEDS`: 03 and 04 run Triton kernels, and Triton publishes wheels for Linux
only; 11 serves with FastAPI, 13 needs the grammar library, 14 peft).

The stored outputs come from a CPU run (float32, token-exact with HF transformers). On a machine with a GPU the
kernels that nbval starts get NANOREF_DEVICE=cpu, so an `LLM(...)` made without `device=` runs on the CPU in
float32, as when the outputs were stored. nanoref's Triton kernels compile for the GPU there, so the cells that run
them put their tensors and engines where the kernels run (`kernel_device()`); the cells that use the GPU on purpose
(CUDA graphs) name it themselves and mark what differs. PYDEVD_DISABLE_FILE_VALIDATION=1 keeps the kernel's debugger
from printing its frozen-modules notice into the first cell's output on some Python builds.

A CPU engine runs nanoref's C++ kernels (the cpp backend) where they build, and the first use on a machine compiles
them, saying so on stderr: that would land in the output of whichever notebook cell first makes an `LLM`. So the
kernels are built (or found in the cache) here, before the first notebook runs, and the notebooks load them."""

from __future__ import annotations

import os

import pytest

from nanoref.testing import missing_packages


def pytest_collection_modifyitems(config, items):
    for item in items:
        missing = missing_packages(item.path.stem) if item.path.suffix == ".ipynb" else []
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"{item.path.name} needs {', '.join(missing)}, not installed here"))


KERNEL_ENV = {"NANOREF_DEVICE": "cpu", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}


_cpp_kernels_ready = False


def build_cpp_kernels() -> None:
    """Build the cpp backend's kernels in this process (once), where this machine can: a failed build is left for
    the notebooks to report (their engines fall back to the torch backend, with a warning)."""
    global _cpp_kernels_ready
    if _cpp_kernels_ready:
        return
    _cpp_kernels_ready = True
    from nanoref.ops import attention_cpp

    if not attention_cpp.missing_build_tools():
        try:
            attention_cpp.load()
        except attention_cpp.CppKernelUnavailableError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel while setting up its first cell: give that kernel KERNEL_ENV, and leave this
    process's environment as it was (the GPU tests in tests/ keep their default device and compiled kernels)."""
    build_cpp_kernels()
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
