"""Shared fixtures: tiny random Qwen3 checkpoints (helper functions live in tests/helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch

from nanoref.testing import make_tiny_qwen3

from .helpers import TINY_CONFIGS

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))
# the processes tests start (engine processes, servers) read this when their torch starts: without it each takes
# every core, and under xdist on a many-core machine their thread pools oversubscribe the cores many times over
os.environ.setdefault("OMP_NUM_THREADS", str(min(2, os.cpu_count() or 1)))


def pytest_sessionstart(session):
    """Build the cpp backend's kernels (the CPU engines' default) before the first test, where this machine can: the
    first engine of a fresh machine would otherwise build them inside whichever test makes it, perhaps in a server
    process that a test gives a startup deadline. A build that fails is left for the engines to report (they fall
    back to the torch backend, with a warning); xdist's workers each run this, the first one builds, the rest wait."""
    from nanoref.ops import attention_cpp

    if not attention_cpp.missing_build_tools():
        try:
            attention_cpp.load()
        except attention_cpp.CppKernelUnavailableError:
            pass


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """Tests not marked `gpu` are CPU tests: an engine made without `device=` runs on the CPU there too, as on CI
    (on a GPU machine the default would be CUDA in bfloat16 with graphs, which those tests do not expect). GPU tests
    keep the default (and name the device themselves)."""
    if "gpu" not in request.keywords:
        monkeypatch.setenv("NANOREF_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_qwen3")
    return {name: make_tiny_qwen3(root / name, seed=i, **cfg) for i, (name, cfg) in enumerate(TINY_CONFIGS.items())}


@pytest.fixture(scope="session")
def tiny_model(tiny_models):
    return tiny_models["gqa2-untied"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
