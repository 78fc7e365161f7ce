"""LoRA adapters: the batched delta against its per-adapter loop, adapters read from PEFT folders and checked, and
the adapted model token-exact with HF transformers + peft."""

from __future__ import annotations

import json

import pytest
import torch

from nanoref import LLM, SamplingParams
from nanoref.lora import LoRARequest
from nanoref.lora.adapters import LoRAAdapterError, load_adapter
from nanoref.lora.manager import LoRAManager
from nanoref.ops.lora import lora_delta, lora_delta_reference

peft = pytest.importorskip("peft", reason="peft is not installed (the LoRA oracle; pip install peft)")

from nanoref.testing import make_random_lora  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# -- the batched delta ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_lora_delta_equals_the_per_adapter_loop(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    num_rows, num_slots, rank, size_in, size_out = [(7, 3, 4, 32, 48), (2, 1, 8, 16, 16), (40, 4, 16, 64, 24)][seed % 3]
    x = torch.randn(num_rows, size_in, generator=g).to(dtype)
    lora_a = torch.randn(num_slots, rank, size_in, generator=g).to(dtype)
    lora_b = torch.randn(num_slots, rank, size_out, generator=g).to(dtype)
    lora_b[:, rank // 2 :] = 0  # an adapter of lower rank than the slots: zero past its own rank
    row_slots = torch.randint(-1, num_slots, (num_rows,), generator=g)
    row_slots[0] = -1  # always a base-model row
    row_slots[1 : 1 + num_slots] = torch.arange(num_slots)[: num_rows - 1]  # and a row under each slot that fits
    scalings = torch.rand(num_slots, generator=g) * 2
    expected = lora_delta_reference(x, lora_a, lora_b, row_slots, scalings)
    got = lora_delta(x, lora_a, lora_b, row_slots, scalings)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    else:  # bf16 rounds x A^T before B: compare by norm (bf16 operands land between 1e-3 and 1e-2)
        error = (got.double() - expected.double()).norm() / expected.double().norm()
        assert error < 1e-2, f"relative error {error:.2e}"
    assert not got[row_slots == -1].any(), "a base-model row got a delta"


# -- adapters from PEFT folders ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "all-r8": make_random_lora(root / "all-r8", tiny_model, rank=8, seed=1),
        "attn-r4-rs": make_random_lora(
            root / "attn-r4-rs", tiny_model, rank=4, targets=("q_proj", "v_proj", "o_proj"), seed=2, use_rslora=True
        ),
        "mlp-r2": make_random_lora(root / "mlp-r2", tiny_model, rank=2, targets=("gate_proj", "down_proj"), seed=3),
    }


def peft_greedy(base_folder, adapter_folder, prompt: list[int], max_new_tokens: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_folder).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def attach(llm: LLM, **limits) -> LoRAManager:
    settings = dict(max_loras=2, max_lora_rank=8, max_cpu_loras=4, max_num_tokens=llm.config.max_num_batched_tokens)
    return LoRAManager(llm.model_runner.model, llm.config.hf_config, **{**settings, **limits})


@pytest.mark.parametrize("name", ["all-r8", "attn-r4-rs", "mlp-r2"])
def test_an_adapted_model_decodes_what_hf_with_peft_decodes(tiny_model, adapters, name):
    prompt = [5, 17, 33, 2, 99, 100, 7, 61]
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    manager = attach(llm)
    slots = manager.assign_slots([LoRARequest(name, 1, adapters[name])])
    manager.row_slots.fill_(slots[1])  # every row under this adapter
    got = llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert got == peft_greedy(tiny_model, adapters[name], prompt, GREEDY.max_tokens)
    manager.row_slots.fill_(-1)  # base-model rows: the base model's tokens
    llm.scheduler.block_manager.forget_cached_prefixes()  # (the adapter's K/V must not be reused here)
    from .helpers import hf_greedy

    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(tiny_model, prompt, 10)


def test_adapters_beyond_the_slots_are_swapped_in_least_recently_used_first(tiny_model, adapters):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=64)
    manager = attach(llm, max_loras=2)
    a, b, c = (LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(adapters))
    assert manager.assign_slots([a, b]) == {1: 0, 2: 1}
    manager.assign_slots([a])  # a used last: b is the least recently used slot
    assert manager.assign_slots([c]) == {3: 1}
    assert manager.slot_ids == [1, 3]
    with pytest.raises(ValueError, match="needs 3 adapters, but max_loras is 2"):
        manager.assign_slots([a, b, c])


# -- folders that cannot be served ----------------------------------------------------------------------------
def broken(tmp_path, source, edit_config=None, drop=None):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(source, folder)
    if drop:
        (folder / drop).unlink()
    if edit_config:
        path = folder / "adapter_config.json"
        settings = json.loads(path.read_text())
        edit_config(settings)
        path.write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize(
    ("edit", "drop", "message"),
    [
        (None, "adapter_config.json", "adapter_config.json is missing"),
        (None, "adapter_model.safetensors", "adapter_model.safetensors is missing"),
        (lambda s: s.update(r=64), None, "rank r=64 is above max_lora_rank=8"),
        (lambda s: s.update(target_modules=["q_proj", "lm_head"]), None, "target module 'lm_head'"),
        (lambda s: s.update(use_dora=True), None, "use_dora=True is not supported"),
        (lambda s: s.update(r=4), None, "do not fit this model"),  # the weights are rank 8
    ],
)
def test_a_broken_adapter_folder_is_a_clear_error_and_loads_nothing(
    tiny_model, adapters, tmp_path, edit, drop, message
):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32)
    manager = attach(llm)
    folder = broken(tmp_path, adapters["all-r8"], edit, drop)
    with pytest.raises(LoRAAdapterError, match=message):
        manager.assign_slots([LoRARequest("broken", 1, folder)])
    assert not manager.host and manager.slot_ids == [None, None]
    assert all(not a.any() for slots in manager.slots.values() for a in slots.lora_a)


@pytest.mark.parametrize(
    ("value", "dtype", "message"),
    [
        (float("nan"), torch.float32, r"layer 1 self_attn.qkv_proj piece 2: lora_B holds NaN or infinite values$"),
        (float("-inf"), torch.float32, "lora_B holds NaN or infinite values"),
        (1e5, torch.float16, r"lora_B holds NaN or infinite values \(in float16\)"),  # (past float16's 65,504)
    ],
)
def test_an_adapter_with_weights_that_are_not_finite_is_refused(tiny_model, adapters, tmp_path, value, dtype, message):
    """The slots' masked product multiplies every slot's B by 0 for rows of other slots, and 0 x NaN is NaN: such an
    adapter, served, turned every row of every step NaN (greedy: token 0), base-model rows and other adapters' too,
    for as long as it stayed in a slot."""
    from safetensors.torch import load_file, save_file

    folder = broken(tmp_path, adapters["all-r8"])
    tensors = load_file(folder / "adapter_model.safetensors")
    key = next(k for k in tensors if ".layers.1.self_attn.v_proj.lora_B" in k)
    tensors[key][3, 5] = value
    save_file(tensors, folder / "adapter_model.safetensors")
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=32, dtype=dtype)
    manager = attach(llm)
    with pytest.raises(LoRAAdapterError, match=message):
        manager.assign_slots([LoRARequest("broken", 1, folder)])
    assert not manager.host and manager.slot_ids == [None, None]
    if dtype == torch.float32:
        return
    manager.assign_slots([LoRARequest("fine", 2, adapters["all-r8"])])  # (the adapter it broke, as it was: served)


@pytest.mark.parametrize("alpha", ["Infinity", "NaN", "1e400"])
def test_a_lora_alpha_that_is_not_finite_is_refused(tiny_model, adapters, tmp_path, alpha):
    """An infinite scaling is NaN for every row of the other slots (0 x inf) too."""
    folder = broken(tmp_path, adapters["all-r8"])
    path = folder / "adapter_config.json"
    path.write_text(path.read_text().replace('"lora_alpha": 16', f'"lora_alpha": {alpha}'))
    assert alpha in path.read_text()
    manager = attach(LLM(tiny_model, device="cpu", num_kvcache_blocks=32))
    with pytest.raises(LoRAAdapterError, match="lora_alpha must be a finite number"):
        manager.assign_slots([LoRARequest("broken", 1, folder)])


def test_an_adapter_of_a_sparse_layers_mlp_is_refused_naming_it(tmp_path):
    """A LoRA tensor for the MLP of a Qwen3-MoE sparse layer (whose experts take no adapter here) is named, not an
    index into slots that do not exist."""
    from safetensors.torch import save_file

    from nanoref.models import load_model_config
    from nanoref.testing import make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(tmp_path / "moe", mlp_only_layers=[0, 3], seed=3)
    _, _, config = load_model_config(model)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.ones(2, 128), f"{prefix}.lora_B.weight": torch.ones(64, 2)}
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="adapts 'down_proj' of layer 1, a sparse .* nanoref does not adapt"):
        load_adapter(folder, "a", 1, config, max_lora_rank=8)


def test_an_adapter_for_another_model_is_refused(tiny_models, adapters):
    other = tiny_models["gqa4-bias"]  # other head counts and sizes
    llm = LLM(other, device="cpu", num_kvcache_blocks=32)
    with pytest.raises(LoRAAdapterError, match="do not fit this model|names layer"):
        attach(llm).assign_slots([LoRARequest("a", 1, adapters["all-r8"])])


def test_a_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/x")
