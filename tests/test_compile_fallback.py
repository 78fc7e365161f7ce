"""The compiled layers' bookkeeping (utils/compile.py), checked without a GPU: which calls share a compiled copy,
and what happens when dynamo refuses to compile once more. tests/test_compile_gpu.py runs the real thing."""

from __future__ import annotations

import warnings

import pytest
import torch

from nanoref.layers.layernorm import rms_norm
from nanoref.utils import compile as compile_module
from nanoref.utils.compile import compile_key, on_cuda


def test_calls_that_differ_only_in_token_count_share_a_compiled_copy():
    weight = torch.ones(4, 32)
    small, large = torch.randn(3, 4, 32), torch.randn(300, 4, 32)
    assert compile_key(small, weight, 1e-6) == compile_key(large, weight, 1e-6)


@pytest.mark.parametrize(
    "other",
    [
        (torch.randn(3, 8, 32), torch.ones(8, 32), 1e-6),  # another head count
        (torch.randn(3, 4, 64), torch.ones(4, 64), 1e-6),  # another head dim
        (torch.randn(3, 4, 32), torch.ones(4, 32), 1e-5),  # another eps
        (torch.randn(3, 4, 32, dtype=torch.bfloat16), torch.ones(4, 32, dtype=torch.bfloat16), 1e-6),  # a dtype
    ],
)
def test_another_model_gets_a_compiled_copy_of_its_own(other):
    """Each model shape has its own copy, so building engines of many models in one process never runs one copy
    into dynamo's recompile limit (8 per code object; nine engines in one process used to crash the ninth)."""
    assert compile_key(torch.randn(3, 4, 32), torch.ones(4, 32), 1e-6) != compile_key(*other)


def test_a_layer_at_the_recompile_limit_runs_eagerly_and_says_so_once(monkeypatch):
    def refusing_compile(fn, **options):
        def run(*args, **kwargs):
            raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")

        return run

    monkeypatch.setattr(compile_module, "_wants_compile", lambda x: True)  # as if x were on a GPU
    monkeypatch.setattr(torch, "compile", refusing_compile)
    norm = on_cuda(rms_norm)
    x, weight = torch.randn(5, 4, 32), torch.randn(32)
    with pytest.warns(RuntimeWarning, match="recompile limit.*runs eagerly"):
        out = norm(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm(x, weight, 1e-6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call of the same shapes: eager, silently
        torch.testing.assert_close(norm(x * 2, weight, 1e-6), rms_norm(x * 2, weight, 1e-6))


def test_other_compile_errors_still_raise(monkeypatch):
    def broken_compile(fn, **options):
        def run(*args, **kwargs):
            raise RuntimeError("an inductor bug")

        return run

    monkeypatch.setattr(compile_module, "_wants_compile", lambda x: True)
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.raises(RuntimeError, match="an inductor bug"):
        on_cuda(rms_norm)(torch.randn(5, 32), torch.randn(32), 1e-6)
