"""LoRA adapters served per request through `LLM(enable_lora=True)`: mixed batches of adapters and base-model rows
token-exact with HF transformers + peft, the prefix cache keyed by adapter, preemption, chunked prefill, more
adapters than slots, speculative decoding, and requests and settings that cannot be served."""

from __future__ import annotations

import pytest
import torch

from nanoref import LLM, LoRARequest, SamplingParams
from nanoref.lora import LoRAAdapterError
from nanoref.ops.lora import lora_delta

from .helpers import assert_no_block_leaked, decode_launches_never_wait, hf_greedy, shared_prefix_prompts

peft = pytest.importorskip("peft", reason="peft is not installed (the LoRA oracle; pip install peft)")

from nanoref.testing import make_random_lora  # noqa: E402

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, LoRARequest]:
    """Four random adapters of different ranks and targets, as requests (ids 1..4)."""
    root = tmp_path_factory.mktemp("lora_engine")
    folders = {
        "all-r8": make_random_lora(root / "all-r8", tiny_model, rank=8, seed=11),
        "attn-r4-rs": make_random_lora(
            root / "attn-r4-rs", tiny_model, rank=4, targets=("q_proj", "k_proj", "v_proj"), seed=12, use_rslora=True
        ),
        "mlp-r2": make_random_lora(root / "mlp-r2", tiny_model, rank=2, targets=("up_proj", "down_proj"), seed=13),
        "o-r16": make_random_lora(root / "o-r16", tiny_model, rank=16, targets=("o_proj", "gate_proj"), seed=14),
    }
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(folders.items())}


_PEFT: dict = {}


def expected(base_folder, lora: LoRARequest | None, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """HF transformers' greedy tokens, through peft's PeftModel where the request names an adapter."""
    if lora is None:
        return hf_greedy(base_folder, prompt, max_tokens)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (str(base_folder), lora.lora_path)
    if key not in _PEFT:
        base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
        _PEFT[key] = PeftModel.from_pretrained(base, lora.lora_path).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _PEFT[key].generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_tokens)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_exact(base_folder, prompts, loras, outputs, max_tokens: int = MAX_TOKENS) -> None:
    for i, (prompt, lora, output) in enumerate(zip(prompts, loras, outputs)):
        name = "the base model" if lora is None else lora.lora_name
        assert output["token_ids"] == expected(base_folder, lora, prompt, max_tokens), f"prompt {i} under {name}"


def lora_llm(folder, **settings) -> LLM:
    return LLM(folder, device="cpu", enable_lora=True, **{"max_loras": 4, "max_lora_rank": 16, **settings})


# -- mixed batches --------------------------------------------------------------------------------------------
def test_one_batch_of_four_adapters_and_base_rows_decodes_what_hf_with_peft_decodes(tiny_model, adapters):
    """Every adapter and the base model in one generate call (one flat batch per step), each prompt also under
    other adapters: the same tokens run under different weights row by row."""
    prompts = shared_prefix_prompts(seed=5, prefix_len=20, suffix_lens=[3, 9, 1, 14, 6, 2])
    a, b, c, d = adapters.values()
    loras = [a, b, None, c, d, a]
    llm = lora_llm(tiny_model, num_kvcache_blocks=64)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert len({tuple(o["token_ids"]) for o in outputs}) > 1
    assert any(step.num_seqs == len(prompts) for step in llm.metrics.steps), "meant to run as one batch"
    assert_exact(tiny_model, prompts, loras, outputs)
    assert_no_block_leaked(llm)


def test_one_lora_request_serves_every_prompt_and_a_list_may_mix_in_the_base_model(tiny_model, adapters):
    prompts = [[5, 17, 33, 2, 99], [7, 7, 1, 250]]
    llm = lora_llm(tiny_model, num_kvcache_blocks=32)
    lora = adapters["all-r8"]
    assert_exact(tiny_model, prompts, [lora, lora], llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora))
    loras = [None, lora]
    assert_exact(tiny_model, prompts, loras, llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert llm.lora.num_requests == {"all-r8": 3}  # requests per adapter name (the base model's are not counted)


def test_the_same_prompt_under_each_adapter_never_reads_another_ones_kv(tiny_model, adapters):
    """The prefix cache keys blocks by adapter: a prompt computed under the base model (or adapter A) is not
    served to a request under B, which computes its own K/V (no hit); the same adapter again does hit."""
    prompt = shared_prefix_prompts(seed=6, prefix_len=48, suffix_lens=[5])[0]  # three full blocks to share
    llm = lora_llm(tiny_model, num_kvcache_blocks=64)
    order = [None, adapters["all-r8"], adapters["attn-r4-rs"], adapters["all-r8"], None]
    hits = []
    for lora in order:  # one call each: the earlier calls' blocks are in the cache
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=[lora], return_metrics=True)[0]
        assert out["token_ids"] == expected(tiny_model, lora, prompt), f"under {lora}"
        hits.append(out["metrics"].num_cached_tokens)
    assert hits[:3] == [0, 0, 0], f"a request read K/V computed under another adapter: {hits}"
    assert hits[3] >= 48 and hits[4] >= 48, f"the same adapter (and the base) again should hit: {hits}"


def test_preemption_and_chunked_prefill_stay_exact_with_mixed_adapters(tiny_model, adapters):
    """So few KV blocks that decode preempts, and so few tokens per step that prompts are prefilled in chunks:
    a recomputed sequence gets its adapter back (and its own cached prefix), a chunk its adapter's rows."""
    prompts = shared_prefix_prompts(seed=7, prefix_len=32, suffix_lens=[40, 5, 23, 11, 30])
    loras = [adapters["all-r8"], None, adapters["mlp-r2"], adapters["all-r8"], adapters["o-r16"]]
    llm = lora_llm(tiny_model, num_kvcache_blocks=14, kvcache_block_size=16, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert llm.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert max(len(p) for p in prompts) > 24, "a prompt longer than a step's tokens: prefilled in chunks"
    assert_exact(tiny_model, prompts, loras, outputs, max_tokens=24)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize("middle", [50, 40], ids=["refused-then-blocked", "refused-then-admitted"])
def test_a_prompt_prefilled_in_chunks_goes_before_one_its_adapter_kept_waiting(tiny_model, adapters, middle):
    """max_loras 1: the second request (another adapter) is refused, the third (the first's adapter) starts and is
    cut into chunks behind it. The chunked one must continue first: behind a refused request that then waits for
    blocks it held its own forever ("nothing could be scheduled"), and once the refused one was admitted beside it
    a step mixed two adapters (ValueError from the adapter slots)."""
    prompts = [[(7 * i) % 250 + 3 for i in range(length)] for length in (10, middle, 100)]
    x, y = adapters["all-r8"], adapters["mlp-r2"]
    loras = [x, y, x]
    llm = lora_llm(tiny_model, max_loras=1, max_num_batched_tokens=16, num_kvcache_blocks=10, kvcache_block_size=16)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert_exact(tiny_model, prompts, loras, outputs)
    assert_no_block_leaked(llm)


def test_more_adapters_than_slots_wait_their_turn_and_are_swapped_in_lru(tiny_model, adapters):
    """Four adapters, two slots, three kept on the host: no step ever mixes more than two adapters (the rest
    wait), adapters go in and out of the slots (and the host cache), and every token is still exact."""
    prompts = shared_prefix_prompts(seed=8, prefix_len=4, suffix_lens=[6, 2, 9, 4, 7, 3, 5, 8])
    names = ["all-r8", "attn-r4-rs", "mlp-r2", "o-r16", "all-r8", None, "o-r16", "attn-r4-rs"]
    loras = [None if name is None else adapters[name] for name in names]
    llm = lora_llm(tiny_model, num_kvcache_blocks=64, max_loras=2, max_cpu_loras=3)
    manager = llm.lora.manager
    per_step, loads = [], []
    assign, load = manager.assign_slots, manager._load
    manager.assign_slots = lambda requests: per_step.append(len({r.lora_int_id for r in requests})) or assign(requests)
    manager._load = lambda slot, adapter: loads.append(adapter.int_id) or load(slot, adapter)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert max(per_step) == 2, f"adapters per step: {per_step}"
    assert sorted(set(loads)) == [1, 2, 3, 4], f"four adapters through two slots must swap: {loads}"
    assert len(manager.host) <= 3
    assert_exact(tiny_model, prompts, loras, outputs)


def test_a_waiting_request_whose_adapter_has_no_slot_lets_the_requests_behind_it_start(tiny_model, adapters):
    """One slot, adapter A running: a waiting request on adapter B keeps its place in line (as vLLM's scheduler
    skips it), while the base-model and adapter-A requests queued behind it start in the same prefill step; B starts
    once A's requests are done, and every token is exact."""
    a, b = adapters["all-r8"], adapters["mlp-r2"]
    llm = lora_llm(tiny_model, num_kvcache_blocks=64, max_loras=1, max_cpu_loras=2)
    first = llm.add_request([1, 2, 3, 4, 5], GREEDY, lora_request=a)
    llm.step()  # A's request runs
    prompts = [[6, 7, 8], [9, 10, 11, 12], [13, 14], [15, 16, 17]]
    loras = [b, None, a, b]
    seqs = [llm.add_request(prompt, GREEDY, lora_request=lora) for prompt, lora in zip(prompts, loras)]
    llm.step()
    assert list(llm.scheduler.waiting) == [seqs[0], seqs[3]], "B's requests wait, keeping their place in line"
    assert list(llm.scheduler.running) == [first, seqs[1], seqs[2]], "the requests behind B's first did not start"
    while not llm.is_finished():
        llm.step()
    for i, (seq, prompt, lora) in enumerate(zip(seqs, prompts, loras)):
        assert seq.completion_token_ids == expected(tiny_model, lora, prompt), f"request {i}"
    assert first.completion_token_ids == expected(tiny_model, a, [1, 2, 3, 4, 5])


def test_a_step_of_base_model_rows_alone_skips_the_delta_and_stays_exact(tiny_model, adapters):
    """An eager step whose rows are all base-model rows adds nothing (every row's delta is zero): the delta is not
    computed at all; a step with one adapted row computes it for every adapted projection."""
    from nanoref.utils import seams

    from .helpers import Counting

    llm = lora_llm(tiny_model, num_kvcache_blocks=32)
    counting = Counting(lora_delta)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    with seams.use(lora_delta=counting):
        assert_exact(tiny_model, prompts, [None, None], llm.generate(prompts, GREEDY, use_tqdm=False))
        assert counting.calls == 0
        loras = [None, adapters["all-r8"]]
        assert_exact(tiny_model, prompts, loras, llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    layers, pieces_per_layer = llm.config.hf_config.num_hidden_layers, 3 + 1 + 2 + 1  # q, k, v, o, gate, up, down
    assert counting.calls == MAX_TOKENS * layers * pieces_per_layer  # every step: every piece of every layer


def test_decode_replayer_runs_the_recording_without_the_delta_for_steps_of_base_rows(tiny_model, adapters):
    """With adapters, decode graphs are recorded twice (GraphsByRowMix): a step whose rows are all base-model rows
    replays the recording without the delta, any other step the one with it, token-exact either way. On a CPU the
    recordings are the bucketed eager mode, so this checks the choice; the GPU test below the capture."""
    from nanoref.cuda_graphs import DecodeGraphs
    from nanoref.lora.hooks import GraphsByRowMix

    llm = lora_llm(tiny_model, num_kvcache_blocks=64)
    runner, manager = llm.model_runner, llm.lora.manager
    replayer = runner.decode_graphs = llm.lora.decode_graphs(runner, lambda: DecodeGraphs(runner, record=False))
    assert isinstance(replayer, GraphsByRowMix) and manager.record_base_only is False
    assert llm.lora.decode_graphs(object(), lambda: "one recording") == "one recording"  # another runner's (a draft)
    ran = []

    def counted(name: str, run):
        return lambda *args: ran.append(name) or run(*args)

    for name in ("mixed", "base"):
        recording = getattr(replayer, name)
        recording.run = counted(name, recording.run)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    for loras, recording in (([None, None], "base"), ([None, adapters["all-r8"]], "mixed")):
        ran.clear()
        assert_exact(tiny_model, prompts, loras, llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
        assert ran == [recording] * (MAX_TOKENS - 1), f"{loras}: decode steps ran {ran}"


def test_one_slot_and_one_host_place_serve_adapters_one_after_another(tiny_model, adapters):
    """vLLM's defaults (max_loras = max_cpu_loras = 1): each new adapter takes the host place of the one before
    (never its own place: the adapter just read must stay until it is in its slot)."""
    llm = LLM(tiny_model, device="cpu", enable_lora=True, num_kvcache_blocks=32)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    loras = [adapters["all-r8"], adapters["mlp-r2"], adapters["all-r8"]]
    assert_exact(tiny_model, prompts, loras, llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert len(llm.lora.manager.host) == 1


def test_samples_streams_chat_and_add_request_carry_the_adapter(tiny_model, adapters):
    lora = adapters["attn-r4-rs"]
    llm = lora_llm(tiny_model, num_kvcache_blocks=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = expected(tiny_model, lora, prompt)
    # (greedy takes only n=1, as in vLLM: each seeded sample equals its own seed run alone, adapted, on an engine
    # with no prefix cache; the adapter changes those samples, so a sample run without it would not pass)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
    alone = lora_llm(tiny_model, num_kvcache_blocks=64, enable_prefix_caching=False)
    each = [SamplingParams(temperature=1.0, seed=5 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(2)]
    adapted = [o["token_ids"] for o in alone.generate([prompt] * 2, each, use_tqdm=False, lora_request=lora)]
    base = [o["token_ids"] for o in alone.generate([prompt] * 2, each, use_tqdm=False)]
    assert [o["token_ids"] for o in out["outputs"]] == adapted
    assert all(a != b for a, b in zip(adapted, base)), "the adapter was meant to change every sample"
    seq = llm.add_request(prompt, GREEDY, lora_request=lora)
    while not llm.is_finished():
        llm.step()
    assert seq.completion_token_ids == want


def test_chat_and_stream_take_a_lora_request(tmp_path):
    from nanoref import DEFAULT_MODEL
    from nanoref.engine.chat import chat_prompt

    lora = LoRARequest("chat", 1, str(make_random_lora(tmp_path / "chat", DEFAULT_MODEL, rank=4, seed=3)))
    llm = LLM(DEFAULT_MODEL, device="cpu", enable_lora=True, num_kvcache_blocks=64)
    conversation = [{"role": "user", "content": "hi"}]
    got = llm.chat(conversation, GREEDY, use_tqdm=False, lora_request=lora)[0]["token_ids"]
    prompt = llm.tokenize(chat_prompt(llm.tokenizer, conversation, llm.config.model_folder))
    assert got == expected(DEFAULT_MODEL, lora, prompt)
    assert got != expected(DEFAULT_MODEL, None, prompt)
    pieces = list(llm.stream(prompt, GREEDY, lora_request=lora))  # (a stream needs the tokenizer this model has)
    assert [token for piece in pieces for token in piece.token_ids] == got


# -- speculative decoding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_verifies_under_each_requests_adapter(tiny_models, adapters, method):
    """The target's verify rows carry their sequence's slot (k + 1 rows each); a draft model proposes without
    adapters. Greedy output is the adapted target's, token for token."""
    tiny_model = tiny_models["gqa2-untied"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    if method == "draft_model":
        # (every step verifies: a draft this size would not pay, and the policy would run every step plain)
        spec = {"model": tiny_models["gqa1-tied"], "num_speculative_tokens": 2, "min_tokens_per_step": 0}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 1], [4, 2, 4, 2, 4, 2]]
    loras = [adapters["all-r8"], None, adapters["mlp-r2"]]
    llm = lora_llm(tiny_model, num_kvcache_blocks=64, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert any(step.num_draft_tokens for step in llm.metrics.steps), "meant to run verify steps"
    assert_exact(tiny_model, prompts, loras, outputs, max_tokens=12)


# -- what cannot be served -----------------------------------------------------------------------------------
def test_a_lora_request_without_enable_lora_is_refused(tiny_model, adapters):
    llm = LLM(tiny_model, device="cpu", num_kvcache_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=adapters["all-r8"])
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.add_request([1, 2, 3], GREEDY, lora_request=adapters["all-r8"])
    assert llm.is_finished()
    # a list of None entries asks for no adapter: the base model serves it
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=[None])[0]["token_ids"]


def test_lora_request_must_be_a_lora_request_one_per_prompt(tiny_model, adapters):
    llm = lora_llm(tiny_model, num_kvcache_blocks=16)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest or None, got str"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request="all-r8")
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([[1, 2], [3, 4]], GREEDY, use_tqdm=False, lora_request=[adapters["all-r8"]])
    assert llm.is_finished() and not llm.lora.manager.host


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("missing", "adapter_model.safetensors is missing"),
        ("rank", "rank r=16 is above max_lora_rank=8"),
        ("target", "target module 'lm_head' is not one nanoref adapts"),
    ],
)
def test_a_bad_adapter_fails_the_call_and_leaves_nothing_queued_or_loaded(
    tiny_model, adapters, tmp_path, edit, message
):
    """A good adapter for prompt 0 and a bad one for prompt 1: the call raises naming the folder's problem, no
    request is queued, and neither adapter stays loaded; the engine then serves the good one."""
    import json
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(adapters["all-r8"].lora_path, folder)
    settings = json.loads((folder / "adapter_config.json").read_text())
    if edit == "missing":
        (folder / "adapter_model.safetensors").unlink()
    elif edit == "target":
        settings["target_modules"] = ["q_proj", "lm_head"]
    elif edit == "rank":  # (its rank is read before its weights)
        settings["r"] = 16
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    llm = lora_llm(tiny_model, num_kvcache_blocks=32, max_lora_rank=8 if edit == "rank" else 16)
    good = adapters["attn-r4-rs"]
    bad = LoRARequest("bad", 9, str(folder))
    with pytest.raises(LoRAAdapterError, match=f"prompt 1: LoRA adapter 'bad' \\({folder}\\): .*{message}"):
        llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY, use_tqdm=False, lora_request=[good, bad])
    assert llm.is_finished()
    assert not llm.lora.manager.host and llm.lora.manager.slot_ids == [None] * 4
    assert_exact(tiny_model, [[1, 2, 3]], [good], llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=good))


def test_an_adapter_id_that_already_names_another_adapter_is_refused(tiny_model, adapters):
    llm = lora_llm(tiny_model, num_kvcache_blocks=32)
    llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=adapters["all-r8"])
    other = LoRARequest("other", adapters["all-r8"].lora_int_id, adapters["mlp-r2"].lora_path)
    with pytest.raises(ValueError, match="lora_int_id 1 already names 'all-r8'"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=other)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(enable_lora="yes"), "enable_lora must be True or False"),
        (dict(max_loras=0), "max_loras must be a positive integer, got 0"),
        (dict(max_lora_rank=True), r"max_lora_rank must be one of \[1, 8, 16, 32, 64, 128, 256, 320, 512\], got True"),
        # (vLLM's ranks only, as vLLM: a rank between them, or past 512, is its ValueError)
        (dict(max_lora_rank=4), r"max_lora_rank must be one of \[1, 8, .*, 512\], got 4"),
        (dict(max_lora_rank=1024), r"max_lora_rank must be one of .*, got 1024"),
        (dict(max_lora_rank=0), r"max_lora_rank must be one of .*, got 0"),
        (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be an integer >= max_loras \(4\)"),
        (dict(enable_lora=True, tensor_parallel_size=2), "enable_lora runs on one device"),
    ],
)
def test_lora_settings_are_checked(tiny_model, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, device="cpu", **settings)


def test_lora_slots_larger_than_memory_are_an_error_naming_the_settings(tiny_model, monkeypatch):
    # a max_loras with digits too many: the slots of every adapted projection are more than there is
    settings = dict(device="cpu", num_kvcache_blocks=8, enable_lora=True, max_lora_rank=512, max_loras=2 * 10**10)
    with pytest.raises(ValueError, match=r"max_lora_rank=512 with max_loras=20000000000 needs .* GiB for the LoRA"):
        LLM(tiny_model, **settings)
    # where memory is not known in advance (a GPU), the allocator's failure is that error too
    monkeypatch.setattr("nanoref.lora.manager.cpu_memory_available", lambda fallback: None)
    with pytest.raises(ValueError, match=r"max_lora_rank=512 with .* but they could not be allocated: lower"):
        LLM(tiny_model, **settings)


def test_lora_slots_are_allocated_before_the_kv_cache_is_sized(tiny_model, adapters, monkeypatch):
    """vLLM sets LoRA up before it measures the memory left for the KV cache: memory that holds the slots and the
    cache sized from what they leave starts the engine, with fewer KV blocks. (Sized first, the cache took a quarter
    of all the RAM and the slots found too little left: a ValueError.) On a GPU the same order puts the slots in the
    memory mem_get_info reads as used."""
    import json

    from nanoref.engine import kv_budget
    from nanoref.engine.model_runner import ModelRunner
    from nanoref.lora.manager import LoRASlots

    c = json.loads((tiny_model / "config.json").read_text())
    hidden, inter, layers, kv, hd = (c[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                    "num_key_value_heads", "head_dim"))  # fmt: skip
    heads, loras, rank, itemsize = c["num_attention_heads"], 8, 256, 4  # (float32, the tiny model's dtype)
    # every adapted projection's in + out: qkv (3 pieces of hidden in), o, gate_up (2 pieces), down
    per_layer = 3 * hidden + (heads + 2 * kv) * hd + heads * hd + hidden + 2 * (hidden + inter) + inter + hidden
    slot_bytes = layers * per_layer * loras * rank * itemsize
    block_bytes = 2 * layers * kv * hd * itemsize * 16  # (K and V of every layer, 16 tokens a block)
    total = slot_bytes + 4 * 40 * block_bytes  # the slots, and room for a quarter-share cache of 40 blocks

    held = {"bytes": 0}  # what the engine has taken of `total`: its slots and its KV cache (as a real reading drops)

    def available(fallback=None):
        return total - held["bytes"]

    for module in ("nanoref.engine.kv_budget", "nanoref.engine.model_runner", "nanoref.lora.manager"):
        monkeypatch.setattr(f"{module}.cpu_memory_available", available)
    make_slots, allocate = LoRASlots.__init__, ModelRunner.allocate_kv_cache

    def counted_slots(self, *args, **kwargs):
        make_slots(self, *args, **kwargs)
        held["bytes"] += sum(t.nbytes for t in self.lora_a + self.lora_b)

    def counted_cache(self):
        allocate(self)
        held["bytes"] += self.kv_cache.nbytes

    monkeypatch.setattr(LoRASlots, "__init__", counted_slots)
    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", counted_cache)
    assert kv_budget.cpu_memory_available is available

    base = LLM(tiny_model, device="cpu")  # without adapters the cache takes a quarter of all of it
    assert base.model_runner.kv_bytes_per_token * 16 == block_bytes
    assert base.model_runner.num_kvcache_blocks == total // 4 // block_bytes == 40 + slot_bytes // 4 // block_bytes
    del base
    held["bytes"] = 0
    llm = lora_llm(tiny_model, max_loras=loras, max_lora_rank=rank)
    assert held["bytes"] == slot_bytes + 40 * block_bytes
    # a quarter of what the slots leave: slot_bytes / 4 fewer bytes of cache than without them
    assert llm.model_runner.num_kvcache_blocks == 40
    prompts = shared_prefix_prompts(seed=3, prefix_len=8, suffix_lens=[2, 5])
    loras_used = [adapters["all-r8"], None]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras_used)
    assert_exact(tiny_model, prompts, loras_used, outputs)


def test_attention_adapters_on_a_qwen3_moe_model_match_peft(tmp_path):
    """enable_lora on Qwen3-MoE failed at start with an AttributeError (a sparse layer's MLP has no gate_up_proj): the
    slots now cover attention and the dense layers' MLPs, token-exact with peft; an adapter of the experts (peft's
    target_parameters, with its rank_pattern) is refused naming a field."""
    from nanoref.testing import make_tiny_qwen3_moe

    model = make_tiny_qwen3_moe(tmp_path / "moe", mlp_only_layers=[0, 3], seed=3)  # layers 1 and 2 sparse
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    attention = LoRARequest("attn", 1, str(make_random_lora(tmp_path / "attn", model, rank=8, seed=4, targets=targets)))
    llm = lora_llm(model, num_kvcache_blocks=32)
    prompts = shared_prefix_prompts(seed=5, prefix_len=6, suffix_lens=[3, 7])
    loras = [attention, None]
    assert_exact(model, prompts, loras, llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    experts = LoRARequest("experts", 2, str(make_random_lora(tmp_path / "experts", model, rank=8, seed=6)))
    with pytest.raises(LoRAAdapterError, match="rank_pattern=.* is not supported"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=experts)


def test_lora_settings_have_vllms_defaults(tiny_model):
    from nanoref.config import EngineConfig

    config = EngineConfig(tiny_model, device="cpu")
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (False, 1, 16, 1)
    assert EngineConfig(tiny_model, device="cpu", max_loras=3).max_cpu_loras == 3


# -- on a GPU: decode CUDA graphs, the overlapped loop and verify graphs record each row's slot ------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [False, True], ids=["decode-graphs+overlap", "verify-graphs"])
def test_cuda_graphs_replay_every_rows_adapter(tiny_model, adapters, speculative):
    """The decode graphs are captured after the slots exist and read `row_slots` as an input: replays of one graph
    serve batches of different adapter mixes (and a verify graph its k + 1 rows per sequence), token-exact with HF
    + peft (float32, as the reference)."""
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if speculative else {}
    llm = LLM(tiny_model, device="cuda", dtype="float32", enable_lora=True, max_loras=4, num_kvcache_blocks=64, **spec)
    assert llm.model_runner.decode_graphs is not None
    assert (llm.speculative_loop is not None) if speculative else (llm.overlapped_loop is not None)
    prompts = shared_prefix_prompts(seed=9, prefix_len=16, suffix_lens=[3, 7, 1, 12, 5])
    for loras in (
        [adapters["all-r8"], None, adapters["o-r16"], adapters["mlp-r2"], adapters["attn-r4-rs"]],
        [None, adapters["mlp-r2"], adapters["mlp-r2"], None, adapters["all-r8"]],
        [None] * 5,
    ):  # fmt: skip  (the last: steps of base rows, through the recording without the delta)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert_exact(tiny_model, prompts, loras, outputs)
    graphs = llm.model_runner.decode_graphs
    assert graphs.base.graphs and graphs.mixed.graphs, "both recordings were meant to be captured"
    if not speculative:  # each step's row slots go up without the host waiting for the step in flight
        mixed = [adapters["all-r8"], None, adapters["o-r16"], adapters["mlp-r2"], adapters["attn-r4-rs"]]
        with decode_launches_never_wait(llm):
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=mixed)
        assert_exact(tiny_model, prompts, mixed, outputs)


@pytest.mark.gpu
def test_lora_slots_come_out_of_the_gpu_memory_utilization_share(tiny_model):
    """On a GPU the slots exist when the cache is sized: mem_get_info counts them as used, so the cache has their
    bytes' worth of blocks fewer than without adapters (and the largest prefill it measures runs their delta, whose
    temporaries, 2 x N x S x R floats here, 64 MiB, are the rest of the difference). `del base` leaves base's cache in
    torch's allocator: the new engine hands it back before it loads (on an H100 the slots were carved out of that
    cached segment, which then counted as used: no memory was left for the new cache)."""
    settings = dict(device="cuda", dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4)
    settings.update(max_num_batched_tokens=256, gpu_memory_utilization=0.5)
    base = LLM(tiny_model, **settings)
    base_blocks = base.model_runner.num_kvcache_blocks
    block_bytes = base.model_runner.kv_bytes_per_token * base.model_runner.block_size
    del base
    llm = LLM(tiny_model, enable_lora=True, max_loras=64, max_lora_rank=512, **settings)  # 256 MiB of slots
    slots = llm.lora.manager.slots.values()
    slot_bytes = sum(t.nbytes for s in slots for t in s.lora_a + s.lora_b)
    drop = base_blocks - llm.model_runner.num_kvcache_blocks
    assert slot_bytes // block_bytes <= drop <= (slot_bytes + (128 << 20)) // block_bytes, (drop, slot_bytes)


@pytest.mark.gpu
def test_lora_slots_that_leave_the_cache_no_gpu_memory_are_named(tiny_model):
    """Slots that take the whole gpu_memory_utilization share: the cache's error (a ValueError, as vLLM's) says the
    slots hold it, and what to lower or raise (it was a RuntimeError naming gpu_memory_utilization alone)."""
    slot_bytes = 2 * 1024 * 2048 * 512 * 4  # 2 layers x (every adapted projection's in + out) x S x R x float32
    share = slot_bytes / torch.cuda.mem_get_info()[1]  # the slots alone fill it (the weights and context are more)
    settings = dict(device="cuda", dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4)
    settings.update(max_num_batched_tokens=256, gpu_memory_utilization=share)
    message = (
        r"no memory left for the KV cache: gpu_memory_utilization=.* of the GPU leaves 0.0 MiB after what is held, "
        r"less than one KV block \(.* MiB\); the LoRA slots \(max_loras=2048, max_lora_rank=512\) hold 8.00 GiB of "
        r"it: lower max_loras or max_lora_rank, or raise gpu_memory_utilization, or set num_kvcache_blocks$"
    )
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, enable_lora=True, max_loras=2048, max_lora_rank=512, **settings)


def test_lora_slots_that_a_gpu_could_not_allocate_name_the_lora_settings_alone():
    # the slots are allocated before the KV cache is sized: what a GPU could not hold is weights and slots, which no
    # gpu_memory_utilization frees (an earlier message named it: the cache used to be allocated first)
    from nanoref.lora.manager import slots_too_large

    message = slots_too_large(4, 256, 11 << 30, torch.device("cuda", 0), None)
    assert message == (
        "max_lora_rank=256 with max_loras=4 needs 11.0 GiB for the LoRA slots on cuda:0, but they could not be "
        "allocated: lower max_lora_rank (the largest rank of the adapters served) or max_loras"
    ), message
