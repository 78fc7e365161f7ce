"""Structured output: a grammar's token mask on the constrained rows of the flat batch (nanoref/structured_output.py).

The built-in model cannot write JSON unaided: every output here that parses and validates does so because of the
mask, and the unconstrained requests beside the constrained ones must produce what they produce alone."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install 'nanoref[dev]')")
pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'nanoref[structured]')")

from nanoref import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanoref.layers.logits_processors import LogitsProcessing, apply_token_bitmask, unpack_bitmask  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4", "Once upon a time, in a land far away,"]


def json_params(**settings) -> SamplingParams:
    # compact JSON: the built-in model would otherwise spend its tokens on the whitespace a schema allows
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(max_tokens=80, structured_outputs=constraint, **settings)


constrained = StructuredOutputsParams


def assert_valid(output: dict) -> None:
    assert output["finish_reason"] == "stop", output
    jsonschema.validate(json.loads(output["text"]), SCHEMA)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", seed=0)


def test_the_bitmask_keeps_only_allowed_tokens_of_constrained_rows():
    """apply_token_bitmask against a readable reference: bit t % 32 of word t // 32, bit 31 included (a negative
    int32), a vocabulary that is not a multiple of 32, and rows without a mask left exactly as they were."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 70, torch.tensor([2, 0])
    logits = torch.randn(4, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31, (2, 3), generator=generator, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -(2**31)  # only token 31 of the first word
    expected = logits.clone()
    for a, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if not (int(bitmask[a, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    masked = apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])
    assert masked[2, :32].isfinite().tolist() == [t == 31 for t in range(32)]


def packed(tokens: list[int], words: int, tail: int = 0) -> torch.Tensor:
    """A packed (W,) int32 bitmask allowing `tokens`, with the bits of the last word from `tail` on also set (as
    the grammar library leaves the bits past the vocabulary)."""
    bits = np.zeros(words, dtype=np.uint32)
    for token in tokens:
        bits[token // 32] |= np.uint32(1 << (token % 32))
    if tail:
        bits[-1] |= np.uint32(~((1 << tail) - 1) & 0xFFFFFFFF)
    return torch.from_numpy(bits.view(np.int32))


def test_min_tokens_never_masks_the_only_tokens_a_grammar_allows():
    """A constrained row short of its min_tokens whose grammar allows only a stop token (it is complete) keeps that
    token, with a warning: masking it left the row all -inf and the sampler took token 0 whatever it was. A row
    whose grammar allows more keeps its min_tokens mask; an unconstrained row always does."""
    vocab, words = 70, 3  # (the bits of tokens 70..95 set in the last word: not tokens of this vocabulary)
    only_stop, stop_or_other = packed([37], words, tail=vocab % 32), packed([37, 40], words, tail=vocab % 32)
    masked = [(0, [37]), (1, [37]), (2, [37])]
    with pytest.warns(RuntimeWarning, match="its grammar is complete and allows only a stop token"):
        processing = LogitsProcessing.build(
            [], [*masked, (0, only_stop), (1, stop_or_other)], vocab, torch.device("cpu")
        )
    logits = processing.apply(torch.zeros(3, vocab))
    assert logits[0].isfinite().nonzero().flatten().tolist() == [37], "the grammar's stop token was masked"
    assert logits[1].isfinite().nonzero().flatten().tolist() == [40]
    assert not logits[2, 37].isfinite() and logits[2].isfinite().sum() == vocab - 1


def test_a_grammar_complete_before_min_tokens_ends_with_its_stop_token(llm):
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=8, structured_outputs=constrained(choice=["yes"]))
    with pytest.warns(RuntimeWarning, match="ends before its min_tokens"):
        output = llm.generate(["Answer:"], params, use_tqdm=False)[0]
    assert (output["text"], output["finish_reason"]) == ("yes", "stop")
    assert output["token_ids"][-1] in llm.scheduler.eos_token_ids


def test_json_schema_outputs_validate_greedy_and_sampled_with_n(llm):
    outputs = llm.generate(
        PROMPTS[:2] + PROMPTS[2:],
        [json_params(temperature=0)] * 2 + [json_params(temperature=1.0, seed=7, n=3)] * 2,
        use_tqdm=False,
    )
    samples = outputs[:2] + [sample for output in outputs[2:] for sample in output["outputs"]]
    assert len(samples) == 8
    for sample in samples:
        assert_valid(sample)
    # unconstrained, the same model writes no JSON at all: the mask is what makes these valid
    free = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)
    for output in free:
        with pytest.raises(json.JSONDecodeError):
            json.loads(output["text"])


def test_unconstrained_requests_beside_constrained_ones_produce_what_they_produce_alone(llm):
    plain = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.9, seed=3, max_tokens=24)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(
        PROMPTS[:2] + PROMPTS[2:],
        plain + [json_params(temperature=0), json_params(temperature=0.9, seed=5)],
        use_tqdm=False,
    )
    assert [o["token_ids"] for o in mixed[:2]] == [o["token_ids"] for o in alone]
    for output in mixed[2:]:
        assert_valid(output)


def test_regex_and_choice_outputs_match(llm):
    regex = r"[a-z]{2,5}-\d{2}"
    choices = ["yes", "no", "it depends"]
    params = [
        SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=40, structured_outputs=constrained(regex=regex)),
        SamplingParams(temperature=1.0, seed=2, n=6, max_tokens=40, structured_outputs=constrained(choice=choices)),
    ]
    by_regex, by_choice = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for sample in by_regex["outputs"]:
        assert re.fullmatch(regex, sample["text"]) and sample["finish_reason"] == "stop", sample
    for sample in by_choice["outputs"]:
        assert sample["text"] in choices and sample["finish_reason"] == "stop", sample


def test_a_constrained_samples_logprobs_are_over_the_tokens_its_grammar_allows(llm):
    """As vLLM's (its grammar masks the logits before its sampler takes the raw logprobs; allowed_token_ids apply
    after): at each token the grammar's tokens share all the probability and the top lists them first, also where
    allowed_token_ids narrow what is sampled ("no"'s tokens and EOS: "yes" is listed still, never sampled)."""
    choice = constrained(choice=["yes", "no"])
    no = sorted({*llm.tokenizer.encode("no", add_special_tokens=False), *llm.scheduler.eos_token_ids})
    settings = dict(temperature=1.0, seed=3, max_tokens=10, logprobs=5, structured_outputs=choice)
    params = [SamplingParams(**settings), SamplingParams(**settings, allowed_token_ids=no)]
    free, narrowed = llm.generate([PROMPTS[0]] * 2, params, use_tqdm=False)
    assert narrowed["text"] == "no" and free["text"] in ("yes", "no")
    for output in (free, narrowed):
        for entry in output["logprobs"]:
            allowed = {token: value for token, value in entry.top.items() if value > float("-inf")}
            assert 0 < len(allowed) < 5 and sum(np.exp(list(allowed.values()))) == pytest.approx(1.0, abs=1e-4)
            assert entry.token_id in allowed and list(entry.top)[: len(allowed)] == list(allowed)
    first = llm.tokenizer.encode("y", add_special_tokens=False)[0]
    assert first in narrowed["logprobs"][0].top and narrowed["logprobs"][0].top == free["logprobs"][0].top


def test_a_lark_grammar_is_followed_as_vllm_reads_one(llm):
    """A grammar with no `::=` line is Lark's syntax (vLLM's rule): its `start` rule, terminals and regexes."""
    lark = 'start: item ("," item)*\n// a digit or an x\nitem: DIGIT | "x"\nDIGIT: /[0-9]/'
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=40, structured_outputs=constrained(grammar=lark))
    output = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert re.fullmatch(r"[0-9x](,[0-9x])*", output["text"]) and output["finish_reason"] == "stop", output


def test_a_grammar_and_a_json_object_are_followed(llm):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    by_grammar, by_object = llm.generate(
        PROMPTS[:2],
        [
            SamplingParams(temperature=0.7, seed=4, max_tokens=40, structured_outputs=constrained(grammar=grammar)),
            SamplingParams(
                temperature=0,
                max_tokens=60,
                structured_outputs=constrained(json_object=True, disable_any_whitespace=True),
            ),
        ],
        use_tqdm=False,
    )
    assert re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", by_grammar["text"]) and by_grammar["finish_reason"] == "stop"
    if by_object["finish_reason"] == "stop":  # (an object may outgrow 60 tokens: then it is cut, as any text)
        assert isinstance(json.loads(by_object["text"]), dict)


def test_constrained_outputs_are_the_same_under_preemption_and_chunked_prefill(llm):
    """A preempted sample keeps its tokens and its matcher: recomputed, it goes on where it was. Prompts prefilled
    in chunks sample only at their last chunk. Both give the tokens an unhurried engine gives."""
    prompts = [prompt * 6 for prompt in PROMPTS]
    params = [json_params(temperature=0), json_params(temperature=0.9, seed=11)] * 2
    expected = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(device="cpu", seed=0, kvcache_block_size=16, num_kvcache_blocks=14, max_num_batched_tokens=16)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert any(step.preempted for step in tight.metrics.steps), "the KV budget was meant to force preemption"
    assert min(len(tight.tokenize(prompt)) for prompt in prompts) > 16, "each prompt was meant to take 2+ chunks"
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    for output in outputs:
        assert_valid(output)


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        ({"json": '{"type": 5}'}, "structured_outputs.json: Type should be a string"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "(ab"}, "structured_outputs.regex: Regex parsing error"),
        (
            {"grammar": "root ::= missing"},
            'structured_outputs.grammar: EBNF parser error at line 1, column 10: Rule "missing',
        ),
        (
            {"grammar": "start: missing"},
            "structured_outputs.grammar: Lark error at line 1, column 8: unknown name 'missing'",
        ),
    ],
)
def test_a_constraint_the_library_refuses_is_a_clear_error_and_queues_nothing(llm, constraint, named):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(named)):
        llm.add_request("Hello", params)
    assert llm.is_finished() and not llm.scheduler.waiting and not llm.scheduler.running


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object, got none"),
        ({"json": SCHEMA, "regex": "a"}, "exactly one of json, regex, choice, grammar, json_object, got json, regex"),
        ({"choice": []}, "structured_outputs.choice must be a list of non-empty strings"),
        ({"choice": "yes"}, "structured_outputs.choice must be a list of non-empty strings"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"json": 3}, "structured_outputs.json must be a JSON schema"),
    ],
)
def test_structured_outputs_params_name_a_bad_field(fields, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        StructuredOutputsParams(**fields)


def test_a_grammar_is_compiled_once_per_constraint(llm):
    llm.constrain(json_params())  # (the engine's grammars exist from its first constrained request on)
    first = llm.grammars.compile(StructuredOutputsParams(json=SCHEMA))
    again = llm.grammars.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))  # the dict as text: the same
    other = llm.grammars.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    reordered = llm.grammars.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, sort_keys=True)))
    assert first is again and other is not first and reordered is not first  # (properties come out in their order)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_speculative_engine_runs_constrained_samples_in_plain_steps(llm, method, tmp_path):
    """With speculative_config, a decode step with a constrained sample verifies nothing (its matcher cannot follow
    proposals that may be rejected): every output, constrained or not, is the plain engine's, the constrained ones
    valid, and speculation resumes once the constrained samples are done."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    if method == "draft":
        spec = {
            "method": "draft_model",
            "model": str(llm.config.model_folder),
            "num_speculative_tokens": 2,
            "min_tokens_per_step": 0,
        }  # (a draft as large as the target never pays: the policy would skip it)
    speculative = LLM(device="cpu", seed=0, speculative_config={**spec, "disable_by_batch_size": 0})
    repeat = "1 2 3 4 1 2 3 4 1 2 3 4 1 2 3 4"  # (n-gram lookup finds proposals here)
    params = [json_params(temperature=0), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    expected = llm.generate([PROMPTS[0], repeat], params, use_tqdm=False)
    outputs = speculative.generate([PROMPTS[0], repeat], params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert_valid(outputs[0])
    constrained_steps = len(expected[0]["token_ids"])  # (the constrained sample runs in every step until it ends)
    assert all(s.num_draft_tokens == 0 for s in speculative.metrics.steps[1:constrained_steps])
    assert sum(s.num_draft_tokens for s in speculative.metrics.steps) > 0  # speculation came back after it


def test_penalties_and_stop_strings_apply_to_constrained_rows(llm):
    penalised = json_params(temperature=0.7, seed=9, repetition_penalty=1.3, presence_penalty=0.5, n=2)
    cut = SamplingParams(temperature=0, max_tokens=20, stop=[";"], structured_outputs=constrained(regex="ab;cd"))
    by_penalties, by_stop = llm.generate(PROMPTS[:2], [penalised, cut], use_tqdm=False)
    for sample in by_penalties["outputs"]:
        assert_valid(sample)
    assert (by_stop["text"], by_stop["finish_reason"], by_stop["stop_reason"]) == ("ab", "stop", ";")


def test_a_pydantic_model_and_a_stream(llm):
    """json takes a pydantic model class (its schema); a streamed constrained request's pieces concatenate to the
    text generate gives it."""
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        kind: str = pydantic.Field(max_length=6)
        legs: int = pydantic.Field(ge=0, le=8)

    params = SamplingParams(
        temperature=0.8, seed=13, max_tokens=60,
        structured_outputs=constrained(json=Pet, disable_any_whitespace=True),
    )  # fmt: skip
    pieces = list(llm.stream(PROMPTS[0], params))
    text = "".join(piece.text for piece in pieces)
    assert pieces[-1].finished and pieces[-1].finish_reason == "stop"
    assert text == llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]["text"]
    Pet.model_validate_json(text)


def test_the_overlapped_loop_waits_for_constrained_rows_tokens(llm):
    """A constrained row's matcher needs its last token before the next step's mask: the overlapped loop runs those
    steps as the plain loop does, and gives the same tokens."""
    overlapped = LLM(device="cpu", seed=0, overlap_scheduling=True)
    params = [
        json_params(temperature=0),
        SamplingParams(temperature=0, max_tokens=30),
        json_params(temperature=0.9, seed=2),
    ]
    expected = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    outputs = overlapped.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert_valid(outputs[0])
    assert_valid(outputs[2])


@pytest.mark.gpu
def test_on_cuda_the_mask_rides_beside_decode_graphs_and_the_overlapped_loop(llm):
    """On a GPU (decode graphs and the overlapped loop on): constrained rows validate and are the CPU engine's tokens,
    and the plain rows of the same batch are what they are alone (float32, so batch shape changes no rounding)."""
    cuda = LLM(device="cuda", dtype="float32", seed=0, num_kvcache_blocks=64)
    assert cuda.model_runner.decode_graphs is not None
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [json_params(temperature=0), plain, json_params(temperature=0.9, seed=3), plain]
    outputs = cuda.generate(PROMPTS, params, use_tqdm=False)
    for index in (0, 2):
        assert_valid(outputs[index])
    assert outputs[0]["token_ids"] == llm.generate(PROMPTS[:1], params[:1], use_tqdm=False)[0]["token_ids"]
    for index in (1, 3):
        alone = cuda.generate([PROMPTS[index]], plain, use_tqdm=False)[0]
        assert outputs[index]["token_ids"] == alone["token_ids"]


@pytest.mark.parametrize("threads", [1, 3])
def test_a_steps_bitmasks_filled_together_equal_each_rows_own(llm, monkeypatch, threads):
    """The rows of a step fill their bitmasks in one call (in parallel threads where the machine has cores to spare):
    each row's words are those its own matcher gives alone, whatever state each matcher is in."""
    from nanoref import structured_output

    monkeypatch.setattr(structured_output, "FILL_THREADS", threads)
    tokenizer = llm.tokenizer
    grammars = structured_output.Grammars(tokenizer, llm.config.hf_config.vocab_size, [tokenizer.eos_token_id])
    compiled = grammars.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    constraints = [grammars.constraint(compiled) for _ in range(5)]
    answer = llm.generate(PROMPTS[:1], json_params(temperature=0), use_tqdm=False)[0]["token_ids"]
    for steps, constraint in enumerate(constraints):  # matcher i has taken the first i * 3 tokens of a valid answer
        for token in answer[: steps * 3]:
            assert not constraint.accept(token)
    alone = torch.stack([constraint.allowed() for constraint in constraints])
    assert len({tuple(row.tolist()) for row in alone}) > 2  # the matchers are in different states
    together = structured_output.GrammarConstraint.allowed_batch(constraints)
    assert torch.equal(together, alone)


def test_a_steps_filled_bitmasks_are_taken_as_filled_and_mixed_rows_keep_their_places():
    """packed_allowed takes the (A, W) words the library filled for every row of a step as they are (splitting them
    into rows and stacking them again cost more than the fill: 256 rows, 1 ms of 3 on a 2-core CPU); beside
    allowed_token_ids' packed rows each row keeps its place."""
    from nanoref.layers.logits_processors import pack_token_ids, packed_allowed

    class Filled:
        last = None

        def __init__(self, ids):
            self.words = pack_token_ids(ids, 70)

        @staticmethod
        def allowed_batch(constraints):
            Filled.last = torch.stack([c.words for c in constraints])
            return Filled.last

    grammars = [Filled([1, 2]), Filled([40]), Filled([69])]
    assert packed_allowed(grammars) is Filled.last
    given = pack_token_ids([5, 33], 70)
    mixed = packed_allowed([grammars[0], given, grammars[1], given.clone(), grammars[2]])
    expected = [[1, 2], [5, 33], [40], [5, 33], [69]]
    assert [torch.nonzero(row).flatten().tolist() for row in unpack_bitmask(mixed, 70)] == expected


def test_an_objects_properties_come_out_in_the_schemas_order(llm):
    """The schema is compiled as given (vLLM's order): `name, age, pet`, not sorted."""
    output = llm.generate(PROMPTS[:1], json_params(temperature=0), use_tqdm=False)[0]
    assert list(json.loads(output["text"])) == list(SCHEMA["properties"]) == ["name", "age", "pet"]


def test_a_model_padded_past_its_tokenizer_never_gets_a_padding_token(tmp_path):
    """The grammar library knows the tokenizer's tokens only (a matcher over a model's padding rows costs time, not
    answers): each step's words equal the library's over the whole padded vocabulary, the padding bits are 0, and
    sampled constrained outputs follow the regex (a vocabulary that is not a multiple of 32: the last word is cut)."""
    import shutil

    import xgrammar as xgr

    from nanoref.structured_output import Grammars
    from nanoref.testing import make_random_qwen3

    folder = tmp_path / "padded"
    settings = dict(vocab_size=1024 + 70, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512)  # fmt: skip
    make_random_qwen3(folder, settings)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"nanoref/default_model/{name}", folder / name)
    llm = LLM(str(folder), device="cpu", num_kvcache_blocks=64)
    tokenizer, vocab = llm.tokenizer, 1024 + 70
    assert len(tokenizer) == 1024
    regex = "[a-z ]{4,12}"
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    constraint = grammars.constraint(grammars.compile(StructuredOutputsParams(regex=regex)))
    padded = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(padded).compile_regex(regex))
    whole = xgr.allocate_token_bitmask(1, vocab)
    for token in tokenizer.encode("ab cd", add_special_tokens=False):
        matcher.fill_next_token_bitmask(whole, 0)
        # (the library sets the unused bits past V of its last word: only tokens < V count)
        assert torch.equal(unpack_bitmask(constraint.allowed()[None], vocab), unpack_bitmask(whole, vocab))
        assert not unpack_bitmask(constraint.allowed()[None], vocab)[0, 1024:].any()
        assert not constraint.accept(token) and matcher.accept_token(token)
    params = SamplingParams(
        temperature=1.0, seed=4, n=4, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    for sample in llm.generate(["hello"], params, use_tqdm=False)[0]["outputs"]:
        assert max(sample["token_ids"]) < 1024 and re.fullmatch(regex, sample["text"]), sample


def test_a_stop_token_id_that_completes_the_grammar_is_the_stop_reason(llm):
    """The token that completes a grammar and is one of stop_token_ids ends the request with that id as its
    stop_reason (vLLM's), as any stop id does: the grammar being complete finds no stop string to report instead."""
    eos = min(llm.scheduler.eos_token_ids)  # (ignore_eos: only stop_token_ids can name it as the reason)
    for detokenize in (True, False):
        params = SamplingParams(
            temperature=0,
            max_tokens=12,
            ignore_eos=True,
            stop_token_ids=[eos],
            detokenize=detokenize,
            structured_outputs=constrained(choice=["yes"]),
        )
        output = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
        assert (output.token_ids[-1], output.finish_reason, output.stop_reason) == (eos, "stop", eos), detokenize


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_that_leave_out_what_the_grammar_wants_next_end_the_sample_on_a_stop_token(
    tmp_path, temperature
):
    """Regex "ab" with allowed_token_ids ["a"]: the request's check passes (its first token may be "a"), then the
    grammar wants "b", which they leave out. The sample ends there on its EOS, its text "a" and a warning; not on
    the token an all -inf row gives (token 0: here a special token that is not EOS, as "!" is in Qwen's vocabulary).
    A model whose EOS is "!" (id 1), so that token 0 is not it."""
    import shutil

    folder = tmp_path / "eos"
    shutil.copytree("nanoref/default_model", folder)
    for name, edit in (("config.json", {"eos_token_id": 1}), ("generation_config.json", {"eos_token_id": 1}),
                       ("tokenizer_config.json", {"eos_token": "!"})):  # fmt: skip
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **edit}))
    llm = LLM(str(folder), device="cpu", num_kvcache_blocks=64)
    assert llm.scheduler.eos_token_ids == {1}
    a = llm.tokenizer.encode("a", add_special_tokens=False)
    params = SamplingParams(
        temperature=temperature, seed=1, max_tokens=8, allowed_token_ids=a, structured_outputs=constrained(regex="ab")
    )
    with pytest.warns(RuntimeWarning, match="which its grammar does not allow"):
        output = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert (output["token_ids"], output["text"], output["finish_reason"]) == (a + [1], "a", "stop")
