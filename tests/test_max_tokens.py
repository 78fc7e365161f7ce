"""max_tokens has a bound, named in the message, at every entry point: SamplingParams, generate (fields reassigned
after construction) and the command line."""

from __future__ import annotations

import numpy as np
import pytest

from nanoref import LLM, SamplingParams
from nanoref.__main__ import main

TOO_MANY = [2**31, 2**63 - 1, 2**63, 10**23, np.int64(2**63 - 1)]
BOUND = r"max_tokens must be a positive integer of at most 2\*\*31 - 1 = 2147483647"


@pytest.mark.parametrize("max_tokens", TOO_MANY, ids=repr)
def test_sampling_params_refuse_max_tokens_past_the_bound(max_tokens):
    with pytest.raises(ValueError, match=BOUND):
        SamplingParams(max_tokens=max_tokens)


@pytest.mark.parametrize("max_tokens", TOO_MANY, ids=repr)
def test_generate_refuses_max_tokens_reassigned_past_the_bound(tiny_model, max_tokens):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=4)
    params.max_tokens = max_tokens  # past __post_init__: only the engine's own check can catch it
    with pytest.raises(ValueError, match="prompt 0: " + BOUND):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == 32


def test_the_largest_max_tokens_generates_up_to_max_model_len(tiny_model):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, max_model_len=40)
    params = SamplingParams(temperature=0, max_tokens=2**31 - 1, ignore_eos=True)
    out = llm.generate([list(range(1, 16))], params, use_tqdm=False)
    assert len(out[0]["token_ids"]) == 25  # 15 prompt + 25 generated = max_model_len


@pytest.mark.parametrize("max_tokens", ["2147483648", str(10**23)])
def test_the_cli_refuses_max_tokens_past_the_bound(tiny_model, capsys, max_tokens):
    code = main(["--model", str(tiny_model), "--device", "cpu", "--max-tokens", max_tokens, "ignored"])
    assert code == 2
    assert "error: --max-tokens: max_tokens must be a positive integer of at most 2**31 - 1" in capsys.readouterr().err
