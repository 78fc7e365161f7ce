"""Exercise seams: a learner's function really runs inside the engine, and only inside `use`."""

from __future__ import annotations

import pytest

from nanoref import LLM, SamplingParams
from nanoref.layers.layernorm import add_rms_norm
from nanoref.utils import seams


def test_use_installs_and_restores(tiny_model):
    calls = []

    def counting_add_rms_norm(x, residual, weight, eps):
        calls.append(x.shape)
        return add_rms_norm(x, residual, weight, eps)

    llm = LLM(tiny_model, num_kvcache_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=3)
    reference = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    with seams.use(add_rms_norm=counting_add_rms_norm):
        assert "add_rms_norm" in seams.active()
        replaced = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    assert calls, "the learner's function was never called by the engine"
    assert replaced == reference
    count = len(calls)
    llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    assert len(calls) == count and not seams.active(), "the seam stayed installed after the block"


def test_a_wrong_function_changes_the_output(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=6)
    reference = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    with seams.use(add_rms_norm=lambda x, residual, weight, eps: add_rms_norm(x, residual, weight, eps * 1e6)):
        broken = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert broken != reference


def test_unknown_seam_and_non_function_are_refused():
    with pytest.raises(ValueError, match="no exercise seam named 'rmsnorm'"):
        with seams.use(rmsnorm=print):
            pass
    with pytest.raises(TypeError, match="needs a function"):
        with seams.use(rms_norm=3):
            pass
    assert not seams.active()
