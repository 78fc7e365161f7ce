"""lm-evaluation-harness against `python -m nanoref.serve`, as its users point it at vLLM: the `local-completions`
model on 127.0.0.1, a multiple-choice (loglikelihood) task and a generate_until task defined here (a YAML task and a
JSONL dataset in the test's folder: nothing downloaded), and the scores equal what HF transformers gives the same
model on the same questions.

A loglikelihood request is a completions request with echo, logprobs and max_tokens 1 (0 in older versions): the
harness sums the returned logprobs of the continuation's prompt tokens. A server that drops echo returns no prompt
logprobs, every choice scores 0, and the accuracy is whatever picking the first choice gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("uvicorn")

from nanoref.llm import DEFAULT_MODEL  # noqa: E402

from .helpers import hf_greedy, hf_model  # noqa: E402

pytestmark = pytest.mark.slow  # two processes start (the server, the harness): ~30 s on this CPU

# the built-in model recites the Zen of Python; the answers sit at every position, and the last two questions are
# not in its training text (its choice there is its own)
MULTIPLE_CHOICE = [
    ("Beautiful is better than", ["ugly", "pretty", "nested"], 0),
    ("Explicit is better than", ["complex", "implicit", "dense"], 1),
    ("Flat is better than", ["sparse", "dense", "nested"], 2),
    ("Sparse is better than", ["flat", "dense", "obvious"], 1),
    ("Errors should never pass", ["loudly.", "twice.", "silently."], 2),
    ("Now is better than", ["never.", "later.", "ever."], 0),
    ("The capital of France is", ["Rome", "Paris", "Madrid"], 1),
    ("Two plus two is", ["five", "three", "four"], 2),
]
GENERATE = [
    ("Beautiful is better than", "ugly"),
    ("Simple is better than", "complex"),
    ("Readability", "counts"),
    ("The capital of France is", "Paris"),
]
UNTIL = ["\n", "."]
SPACES = [r"^\s+", r"\s+$"]  # (exact_match compares the answers without their leading and trailing spaces)
MAX_GEN_TOKS = 8

TASKS = {
    "nanoref_zen_mc": """
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "nanoref_zen_gen": f"""
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    regexes_to_ignore: {json.dumps(SPACES)}
""",
}


def write_tasks(folder) -> None:
    rows = {
        "nanoref_zen_mc": [dict(context=c, choices=ch, answer=a) for c, ch, a in MULTIPLE_CHOICE],
        "nanoref_zen_gen": [dict(context=c, answer=a) for c, a in GENERATE],
    }
    for name, body in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        (folder / f"{name}.yaml").write_text(head + body)


def hf_continuation_logprob(tokenizer, context: str, continuation: str) -> float:
    """The sum of HF's log-probabilities of the continuation's tokens after the context, the pair split into tokens
    as the harness splits it (trailing spaces of the context go to the continuation; the whole text is encoded,
    and the continuation is what follows the context's tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, num_context = tokenizer.encode(context + continuation), len(tokenizer.encode(context))
    with torch.no_grad():
        logprobs = hf_model(DEFAULT_MODEL)(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(logprobs[t - 1, whole[t]].item() for t in range(num_context, len(whole)))


def hf_generation(tokenizer, context: str) -> str:
    text = tokenizer.decode(hf_greedy(DEFAULT_MODEL, tokenizer.encode(context), MAX_GEN_TOKS))
    for stop in UNTIL:
        text = text.split(stop)[0]
    return text.strip()


def start_server(env: dict) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "nanoref.serve", "--device", "cpu", "--port", "0", "--served-model-name", "zen"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = server.stdout.readline()  # "nanoref serves 'zen' on http://127.0.0.1:PORT/v1 (Ctrl-C stops it)"
    if " on http://" not in line:
        server.kill()
        raise AssertionError(line + server.communicate(timeout=30)[1])
    return server, line.split(" on ", 1)[1].split()[0]


def test_lm_eval_scores_through_the_server_equal_hf_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_tasks(tmp_path)
    # offline: the datasets are local JSON files, the tokenizer the model's folder; caches in the test's folder
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    server, url = start_server(env)
    try:
        model_args = (
            f"model=zen,base_url={url}/completions,tokenizer={DEFAULT_MODEL},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=60"
        )
        harness = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
             "--tasks", ",".join(TASKS), "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"),
             "--log_samples"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert harness.returncode == 0, harness.stdout[-3000:] + harness.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(60)
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    samples = {
        name: [json.loads(line) for line in next((tmp_path / "out").rglob(f"samples_{name}_*.jsonl")).open()]
        for name in TASKS
    }
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)

    # loglikelihood: each choice's score equals HF's, and so the accuracy
    hf_correct = []
    for sample in sorted(samples["nanoref_zen_mc"], key=lambda s: s["doc_id"]):
        context, choices, answer = MULTIPLE_CHOICE[sample["doc_id"]]
        served = [float(resp[0]) for resp in sample["filtered_resps"]]
        expected = [hf_continuation_logprob(tokenizer, context, " " + choice) for choice in choices]
        assert served == pytest.approx(expected, abs=1e-3), context
        hf_correct.append(max(range(len(choices)), key=expected.__getitem__) == answer)
    hf_accuracy = sum(hf_correct) / len(hf_correct)
    served_accuracy = results["nanoref_zen_mc"]["acc,none"]
    assert served_accuracy == pytest.approx(hf_accuracy)
    print(
        f"loglikelihood accuracy: lm-eval through the server {served_accuracy:.3f}, HF transformers {hf_accuracy:.3f}"
    )

    # generate_until: the harness's answers are HF's greedy continuations, cut at the stop strings
    hf_exact = [hf_generation(tokenizer, context) == answer for context, answer in GENERATE]
    assert results["nanoref_zen_gen"]["exact_match,none"] == pytest.approx(sum(hf_exact) / len(hf_exact))
    for sample in samples["nanoref_zen_gen"]:
        context, _ = GENERATE[sample["doc_id"]]
        assert sample["filtered_resps"][0].strip() == hf_generation(tokenizer, context), context
