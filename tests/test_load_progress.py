"""A large checkpoint loads with a progress bar over its shards (vLLM's); a small one, or a rank other than 0, none."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from nanoref import LLM, SamplingParams
from nanoref.utils import loader

BAR = "Loading safetensors checkpoint shards"


@pytest.fixture(scope="module")
def two_shards(tiny_model, tmp_path_factory):
    """The tiny model with its weights split over two shards."""
    folder = tmp_path_factory.mktemp("two_shards")
    for item in tiny_model.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
    tensors = {}
    for file in tiny_model.glob("*.safetensors"):
        tensors.update(load_file(file))
    names = sorted(tensors)
    for index, part in enumerate((names[::2], names[1::2])):
        save_file({name: tensors[name] for name in part}, folder / f"model-0000{index + 1}-of-00002.safetensors")
    return folder


def test_a_large_checkpoint_shows_one_bar_over_its_shards(two_shards, monkeypatch, capsys):
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)  # (the tiny model counted as large)
    llm = LLM(two_shards, num_kvcache_blocks=16)
    err = capsys.readouterr().err
    assert err.count(BAR) >= 1 and "2/2" in err
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]["token_ids"]


def test_a_small_checkpoint_and_other_ranks_show_none(two_shards, monkeypatch, capsys):
    LLM(two_shards, num_kvcache_blocks=16)
    assert BAR not in capsys.readouterr().err
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    llm = LLM(two_shards, num_kvcache_blocks=16)
    capsys.readouterr()
    loader.load_weights(llm.model_runner.model, two_shards, show_progress=False)  # (what a rank > 0 passes)
    assert BAR not in capsys.readouterr().err


def test_a_failed_load_closes_its_bar(two_shards, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    broken = tmp_path / "broken"
    shutil.copytree(two_shards, broken)
    (broken / "model-00002-of-00002.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(loader.ModelFolderError, match="model-00002-of-00002.safetensors: not a readable"):
        LLM(broken, num_kvcache_blocks=16)
    assert "1/2" in capsys.readouterr().err  # (the first shard loaded, then the error: the bar was closed on the way)
