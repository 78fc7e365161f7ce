"""Train the tiny Qwen3 model that ships in ``nanoref/default_model/``.

The engine needs *some* real checkpoint to demo and test against, but a real
Qwen3 is hundreds of megabytes and needs a model hub. Instead this script
trains a ~1M-parameter Qwen3 from scratch on text that ships with CPython
itself (the Zen of Python plus stdlib docstrings), so the result is small
enough to commit and can be rebuilt offline in a few minutes on a laptop CPU:

    python -m nanoref.train_default_model

The script is deliberately standalone (torch, transformers, tokenizers and
the standard library only): it must not depend on the engine it feeds.
"""

from __future__ import annotations

import argparse
import builtins
import codecs
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import math
import platform
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

EOS = "<|endoftext|>"
VOCAB_SIZE = 1024
CONTEXT = 256
DEFAULT_OUT = Path(__file__).resolve().parent / "default_model"
DEMO_PROMPTS = ("Beautiful is better than", "Simple is better than", "The")

# Builtins whose docstrings change little between CPython releases.
BUILTIN_NAMES = (
    "abs",
    "all",
    "any",
    "ascii",
    "bin",
    "bool",
    "callable",
    "chr",
    "dict",
    "divmod",
    "enumerate",
    "filter",
    "float",
    "format",
    "getattr",
    "hasattr",
    "hash",
    "hex",
    "id",
    "input",
    "int",
    "isinstance",
    "issubclass",
    "iter",
    "len",
    "list",
    "map",
    "max",
    "min",
    "next",
    "object",
    "oct",
    "open",
    "ord",
    "pow",
    "print",
    "range",
    "repr",
    "reversed",
    "round",
    "set",
    "setattr",
    "sorted",
    "str",
    "sum",
    "tuple",
    "type",
    "zip",
)

# Built-in types whose public methods' docstrings are used as well.
TYPE_NAMES = ("bytes", "dict", "float", "int", "list", "set", "str")

# Pure-Python stdlib modules: their module docstring plus the docstrings of
# their public functions and classes (sorted by name, so the order is fixed).
MODULE_NAMES = (
    "argparse",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "dataclasses",
    "difflib",
    "fnmatch",
    "fractions",
    "functools",
    "heapq",
    "json",
    "keyword",
    "operator",
    "posixpath",
    "pprint",
    "random",
    "shlex",
    "statistics",
    "string",
    "textwrap",
    "timeit",
)

# Every Nth document is a copy of the Zen, so it is a strong, recurring
# pattern that the tiny model memorises (this is what makes the demo
# recognisable).
ZEN_EVERY = 4


def zen_of_python() -> str:
    # Importing `this` prints the Zen; silence it and decode the rot13
    # source string ourselves.
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    return codecs.decode(this.s, "rot13").strip()


def stdlib_docstrings() -> list[str]:
    docs = [inspect.getdoc(getattr(builtins, name)) for name in BUILTIN_NAMES]
    for type_name in TYPE_NAMES:
        cls = getattr(builtins, type_name)
        docs.extend(inspect.getdoc(getattr(cls, attr)) for attr in sorted(vars(cls)) if not attr.startswith("_"))
    for mod_name in MODULE_NAMES:
        module = importlib.import_module(mod_name)
        docs.append(inspect.getdoc(module))
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod_name:
                continue  # skip private names and re-exports from other modules
            if inspect.isfunction(obj) or inspect.isclass(obj):
                docs.append(inspect.getdoc(obj))
    # Drop empty and trivially short docstrings; de-duplicate, keeping order.
    return list(dict.fromkeys(d.strip() for d in docs if d and len(d) > 40))


def build_corpus() -> list[str]:
    zen = zen_of_python()
    documents: list[str] = [zen]
    for i, doc in enumerate(stdlib_docstrings(), start=1):
        documents.append(doc)
        if i % ZEN_EVERY == 0:
            documents.append(zen)
    return documents


def train_tokenizer(documents: list[str]) -> PreTrainedTokenizerFast:
    # GPT-2 style byte-level BPE: any byte string is encodable and decoding
    # round-trips exactly. No prefix space, so "Beautiful" at the start of a
    # prompt tokenizes like it does at the start of a line.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=512,
    )


def build_model(vocab_size: int, eos_id: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: two query heads share each KV head
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return Qwen3ForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    # Linear warmup, then cosine decay to 10% of the peak.
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model: Qwen3ForCausalLM,
    data: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    peak_lr: float,
    seed: int,
    log_every: int,
) -> float:
    gen = torch.Generator().manual_seed(seed)
    # Weight decay only on matrices, not on norm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )
    offsets = torch.arange(CONTEXT)
    model.train()
    smoothed = float("nan")
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup=max(1, steps // 20))
        # Random windows over the concatenated corpus. labels == input_ids
        # because Qwen3ForCausalLM shifts them by one internally.
        starts = torch.randint(0, len(data) - CONTEXT, (batch_size, 1), generator=gen)
        batch = data[starts + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * value
        if step % log_every == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}/{steps}  loss {value:.4f}  (avg {smoothed:.4f})  {elapsed:6.1f}s", flush=True)
    model.eval()
    return smoothed


# ChatML, as Qwen3's, for the chat endpoint and LLM.chat: the markers are plain text to this 1,024-token BPE (the
# model never saw a conversation, so its replies are still Zen and docstrings). Tools, an assistant's tool calls and
# tool results are laid out as Qwen3's template lays them out (hermes style: the tools' JSON in a <tools> block of the
# system turn, each call a <tool_call> block, results as <tool_response> blocks in a user turn), without its thinking
# block, and with fewer words around the tools than Qwen3's (this model's whole context is 512 tokens, and its
# tokenizer spends ~160 on one tool's JSON); a conversation without them is plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- \'\\n</tools>\\nTo call a function, write <tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"  # (written into the tools' system turn)
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for tool_call in message['tool_calls'] or [] %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{%- set call = tool_call['function'] or tool_call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_readme(
    out: Path,
    model: Qwen3ForCausalLM,
    *,
    n_params: int,
    n_docs: int,
    n_tokens: int,
    corpus_sha: str,
    steps: int,
    seed: int,
    final_loss: float,
    train_seconds: float,
) -> None:
    c = model.config
    text = f"""# nanoref default model

A tiny, randomly initialised Qwen3 (`Qwen3ForCausalLM`) trained from scratch
on text that ships with CPython, so that nanoref has a real Hugging Face
checkpoint to demo and test with, fully offline.

**This is a toy for demos, not a real language model.** It has memorised the
Zen of Python and recites fragments of stdlib docstrings; nothing more.

## Config

| field | value |
|---|---|
| parameters | {n_params:,} (embeddings tied with the LM head) |
| vocab_size | {c.vocab_size} (byte-level BPE, `{EOS}` is eos/pad/bos) |
| hidden_size | {c.hidden_size} |
| intermediate_size | {c.intermediate_size} |
| num_hidden_layers | {c.num_hidden_layers} |
| num_attention_heads / num_key_value_heads | {c.num_attention_heads} / {c.num_key_value_heads} (GQA) |
| head_dim | {c.head_dim} |
| max_position_embeddings | {c.max_position_embeddings} |
| rope_theta | {c.rope_parameters["rope_theta"]:g} |
| rms_norm_eps | {c.rms_norm_eps:g} |
| weights dtype | float32 |

## Training data

{n_docs} documents ({n_tokens:,} tokens, sha256 `{corpus_sha[:16]}`)
separated by `{EOS}`: the Zen of Python (decoded from the `this`
module, repeated after every {ZEN_EVERY} docstrings) and the docstrings of
selected builtins and pure-Python stdlib modules, read with `inspect.getdoc`.
Built with CPython {platform.python_version()}; other versions may produce a
slightly different corpus because docstrings change between releases.

Trained for {steps} AdamW steps (seed {seed}, context {CONTEXT}) in
{train_seconds / 60:.1f} minutes on {torch.get_num_threads()} CPU threads;
final smoothed loss {final_loss:.3f}.

## Rebuild

```
python -m nanoref.train_default_model            # writes nanoref/default_model/
python -m nanoref.train_default_model --out DIR --steps N --seed S
```
"""
    (out / "README.md").write_text(text)


def verify(out: Path, max_new_tokens: int = 40) -> None:
    # Reload through the generic Auto* entry points, exactly as a user would.
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    for prompt in DEMO_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        text = tokenizer.decode(generated[0], skip_special_tokens=False)
        print(f"--- greedy: {prompt!r}\n{text}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)

    documents = build_corpus()
    corpus_sha = hashlib.sha256(f"\n{EOS}\n".join(documents).encode()).hexdigest()
    print(f"corpus: {len(documents)} documents, {sum(map(len, documents)):,} chars, sha256 {corpus_sha[:16]}")

    tokenizer = train_tokenizer(documents)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    # Encode with the raw backend: the wrapper warns about documents longer
    # than model_max_length, which is irrelevant for a training stream.
    for enc in tokenizer.backend_tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    data = torch.tensor(ids, dtype=torch.long)
    print(f"tokenizer: vocab {len(tokenizer)}, corpus {len(data):,} tokens")

    model = build_model(len(tokenizer), eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    t0 = time.perf_counter()
    final_loss = train(
        model,
        data,
        steps=args.steps,
        batch_size=args.batch_size,
        peak_lr=args.lr,
        seed=args.seed,
        log_every=args.log_every,
    )
    train_seconds = time.perf_counter() - t0
    print(f"training took {train_seconds:.1f}s, final smoothed loss {final_loss:.4f}")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 records its new "TokenizersBackend" class name; the
    # generic fast-tokenizer name loads the same tokenizer.json in both
    # transformers 4 and 5.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    write_readme(
        out,
        model,
        n_params=n_params,
        n_docs=len(documents),
        n_tokens=len(data),
        corpus_sha=corpus_sha,
        steps=args.steps,
        seed=args.seed,
        final_loss=final_loss,
        train_seconds=train_seconds,
    )
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved to {out} ({size / 1e6:.2f} MB)")

    verify(out)


if __name__ == "__main__":
    main()
