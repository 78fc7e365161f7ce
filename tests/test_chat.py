"""Chat messages through the model folder's chat template: LLM.chat and chat_prompt's errors."""

from __future__ import annotations

import json
import shutil

import pytest

from nanoref import DEFAULT_MODEL, LLM, SamplingParams
from nanoref.engine.chat import chat_prompt
from nanoref.utils.loader import load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_the_built_in_model_renders_chatml():
    text = chat_prompt(load_tokenizer(DEFAULT_MODEL), MESSAGES, DEFAULT_MODEL)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_llm_chat_is_generate_on_the_templated_prompt():
    llm = LLM(device="cpu", num_kvcache_blocks=32)
    prompt = chat_prompt(llm.tokenizer, MESSAGES, DEFAULT_MODEL)
    expected = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.chat(MESSAGES, GREEDY, use_tqdm=False) == expected
    assert llm.chat([MESSAGES, MESSAGES[1:]], GREEDY, use_tqdm=False)[0] == expected[0]
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\]\['role'\]"):
        llm.chat([MESSAGES, [{"role": "robot", "content": "x"}]], GREEDY, use_tqdm=False)
    assert llm.is_finished()


def test_a_folder_without_a_template_or_tokenizer_names_what_is_missing(tmp_path, tiny_model):
    folder = tmp_path / "no_template"
    shutil.copytree(DEFAULT_MODEL, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tokenizer_config.json, or a chat_template.jinja"):
        chat_prompt(load_tokenizer(folder), MESSAGES, folder)
    with pytest.raises(ValueError, match="has no tokenizer"):
        chat_prompt(load_tokenizer(tiny_model), MESSAGES, tiny_model)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], TypeError),
        ("hi", TypeError),
        ([{"role": "user"}], TypeError),
        ([{"role": "user", "content": 3}], TypeError),
        ([{"role": "user", "content": "x", "name": "n"}], TypeError),
        ([{"role": "tool", "content": "x"}], ValueError),
    ],
)
def test_bad_messages_are_refused_with_the_message_named(messages, error):
    with pytest.raises(error, match="messages"):
        chat_prompt(load_tokenizer(DEFAULT_MODEL), messages, DEFAULT_MODEL)
