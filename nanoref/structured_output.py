"""Structured output: a request's grammar as a mask on its row of each step's logits (xgrammar does the grammar).

A grammar (from a JSON schema, a regex, a list of choices or EBNF) is compiled once per distinct constraint against
the tokenizer's vocabulary (`Grammars`, cached): the compiled form knows, for each state of the grammar's pushdown
automaton, which tokens may follow. Each sample gets its own matcher (`GrammarConstraint`, kept as
`seq.output.constraint` by the output stage), which

- before a step: writes the tokens its grammar allows next as a packed bitmask, (ceil(V / 32),) int32, bit t of
  word t // 32 set for an allowed token t (`allowed`); the sampling inputs carry it beside the min_tokens masks and
  the sampler's logits processing puts -inf on every other token of that row only (`apply_token_bitmask`);
- after the step: is advanced by the token sampled (`accept`, from the output stage's on_token), and says when the
  grammar is complete: then the request ends with finish_reason "stop".

The matcher's state follows the sample's tokens: a preempted sample keeps its tokens, so its matcher stays right
when it is recomputed. A verify step (speculative decoding) would need the matcher rolled back over rejected
proposals: a speculative engine runs the decode steps that hold a constrained sample plain (speculative/loop.py).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import warnings
from collections import OrderedDict
from typing import Any

import torch

from nanoref.sampling_params import StructuredOutputsParams


def xgrammar() -> Any:
    """The xgrammar module, imported at the first constrained request: an optional dependency (`pip install
    nanoref[structured]`; the rest of the engine runs without it), and one that imports transformers (seconds, and in
    a notebook without ipywidgets a tqdm warning) that `import nanoref` must not pay."""
    try:
        import xgrammar as xgr
    except ImportError:  # pragma: no cover - the dev environment has it
        raise ValueError("structured_outputs needs the xgrammar package: pip install 'nanoref[structured]'") from None
    return xgr


# JSON's optional whitespace, at most this many characters in a row: valid JSON either way, but a model that favours
# whitespace (the built-in one does) would otherwise spend its max_tokens on it and be cut before the JSON ends
MAX_WHITESPACE = 8


# threads that fill a step's bitmasks (half the machine's cores, as xgrammar's "auto"; the other half run the engine)
FILL_THREADS = max(1, (os.cpu_count() or 2) // 2)


@functools.cache
def batch_matcher(threads: int) -> Any:
    """xgrammar's batch filler with this many threads (built once per count: it owns a thread pool)."""
    return xgrammar().BatchGrammarMatcher(max_threads=threads)


class GrammarConstraint:
    """One sample's matcher on a compiled grammar."""

    def __init__(self, compiled: Any, vocab: int, grammar_vocab: int) -> None:
        """vocab: the model's logits width; grammar_vocab: the tokens the grammar knows (the tokenizer's, at most
        vocab): the rest are the model's padding rows, never allowed."""
        xgr = xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab, self.grammar_vocab = vocab, grammar_vocab
        self.bitmask = xgr.allocate_token_bitmask(1, grammar_vocab)  # (1, ceil(G / 32)) int32, reused every step

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, packed: (ceil(V / 32),) int32 (a new tensor: the step keeps it)."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return widen(self.bitmask, self.grammar_vocab, self.vocab)[0]

    @staticmethod
    def allowed_batch(constraints: list[GrammarConstraint]) -> torch.Tensor:
        """`allowed` of many samples at once -> (A, ceil(V / 32)) int32. One state of a grammar can take the matcher
        hundreds of microseconds over a large vocabulary (a sample at a regex's character class: tens of thousands
        of tokens each checked), and a step asks every constrained row: the library fills the rows in parallel
        threads, outside the GIL, while the forward runs on the GPU (vLLM fills its bitmasks the same way)."""
        first = constraints[0]
        bitmask = xgrammar().allocate_token_bitmask(len(constraints), first.grammar_vocab)
        threads = min(len(constraints), FILL_THREADS)
        if threads > 1:
            batch_matcher(threads).batch_fill_next_token_bitmask([c.matcher for c in constraints], bitmask)
        else:  # (one thread: the plain calls cost less than the batch call's setup)
            for index, constraint in enumerate(constraints):
                constraint.matcher.fill_next_token_bitmask(bitmask, index)
        return widen(bitmask, first.grammar_vocab, first.vocab)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token -> whether the sample is done: its grammar is complete, or the token left it
        (only possible where something masked every token the grammar allowed: the sample ends there, warned)."""
        if not self.matcher.accept_token(token_id):
            warnings.warn(
                f"a constrained sample took token {token_id}, which its grammar does not allow (every token it allowed "
                "was masked, as by allowed_token_ids that hold none of them): it ends here, its text short of the "
                "grammar",
                RuntimeWarning,
                stacklevel=2,
            )
            return True
        return self.matcher.is_terminated()


def widen(bitmask: torch.Tensor, grammar_vocab: int, vocab: int) -> torch.Tensor:
    """(A, ceil(G / 32)) words over the grammar's G tokens -> (A, ceil(V / 32)) over the model's V >= G: tokens
    from G on (the padding rows of a model whose vocabulary outgrows its tokenizer) are not allowed. The grammar
    library is given only the tokenizer's tokens: over a model padded far past its tokenizer (the random models
    the benchmarks run, with the built-in tokenizer's 1,024 tokens and Qwen3's 151,936 rows), a matcher otherwise
    spends most of its time rejecting the padding one token at a time."""
    words = (vocab + 31) // 32
    if bitmask.shape[1] == words and grammar_vocab == vocab:
        return bitmask.clone()
    wide = torch.zeros(bitmask.shape[0], words, dtype=torch.int32)
    wide[:, : bitmask.shape[1]] = bitmask
    if grammar_vocab % 32:  # the grammar's last word: bits past G belong to no token of the grammar
        last = grammar_vocab // 32
        wide[:, last] &= (1 << (grammar_vocab % 32)) - 1
    return wide


class Grammars:
    """Compiles a request's StructuredOutputsParams once per distinct constraint, against one tokenizer."""

    def __init__(self, tokenizer, vocab: int, stop_token_ids: list[int], cache_size: int = 256) -> None:
        """vocab: the model's logits width (may exceed the tokenizer's); stop_token_ids: the tokens that end a
        completion (EOS): the only ones a complete grammar allows."""
        xgr = xgrammar()
        self.vocab, self.grammar_vocab = vocab, min(vocab, len(tokenizer))  # (see widen)
        stops = [t for t in stop_token_ids if t < self.grammar_vocab]
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.grammar_vocab, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(info)
        self.cache: OrderedDict[tuple, Any] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()  # (a server compiles in its request thread while the engine's thread may too)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of params (from the cache when compiled before); ValueError naming what the grammar
        library refused (a bad schema, regex or grammar)."""
        key = constraint_key(params)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        kind, text = key[0], key[1]
        whitespace = {"any_whitespace": not params.disable_any_whitespace, "max_whitespace_cnt": MAX_WHITESPACE}
        if kind == "json":
            unenforced = unenforced_keyword(text)
            if unenforced is not None:
                raise ValueError(
                    f"structured_outputs.json: {unenforced}, which the grammar library does not enforce (the output "
                    "would not be bound by it)"
                )
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(text, **whitespace)
            elif kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', **whitespace)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "grammar" and is_lark(text):
                compiled = self.compiler.compile_lark(text)
            else:  # "grammar", and "choice" as the grammar root ::= "a" | "b" | ...
                compiled = self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"structured_outputs.{params.kind}: {library_message(error)}") from None
        with self.lock:
            self.cache[key] = compiled
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def constraint(self, compiled: Any) -> GrammarConstraint:
        """A fresh matcher (one per sample) at the grammar's start."""
        return GrammarConstraint(compiled, self.vocab, self.grammar_vocab)

    def check_allowed_token_ids(self, compiled: Any, allowed_token_ids: list[int] | None) -> None:
        """ValueError where a request's allowed_token_ids hold none of the tokens its grammar allows first: every
        token of its first step would be masked, so it could make no token of its output (it would end at once on a
        token neither allows). One bitmask at the grammar's start: a conflict further on is not looked for."""
        if not allowed_token_ids:
            return
        first = self.constraint(compiled).allowed()  # (ceil(V / 32),) int32 bitmask words
        ids = torch.tensor([t for t in allowed_token_ids if 0 <= t < self.vocab], dtype=torch.long)
        if not bool(((first.long()[ids // 32] >> (ids % 32)) & 1).any()):  # (one gather, not a loop over ids)
            raise ValueError(
                "allowed_token_ids and structured_outputs have no token in common: the grammar allows none of "
                f"{allowed_token_ids!r:.60} as the output's first token, so the request could generate nothing"
            )


def constraint_key(params: StructuredOutputsParams) -> tuple:
    """(kind, the constraint as text, whitespace): what the compiled grammar depends on, hashable."""
    kind, value = params.kind, getattr(params, params.kind)
    if kind == "json":
        if isinstance(value, type):  # a pydantic model class
            value = value.model_json_schema()
        text = value if isinstance(value, str) else json.dumps(value)  # (in its order: the properties come out so)
    elif kind == "choice":  # each choice a string literal (JSON's escapes are EBNF's)
        # (non-ASCII characters as they are: escaped, one outside the BMP is a UTF-16 surrogate pair, two \u escapes
        # that EBNF reads as two lone surrogates, so such a choice could never be written)
        text = "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value)
    elif kind == "json_object":
        text = ""
    else:
        text = value
    return kind, text, params.disable_any_whitespace


def is_lark(grammar: str) -> bool:
    """Whether a grammar is Lark's syntax (`start: item+`) rather than EBNF's (`root ::= item+`): vLLM's rule, no line
    (comments aside) defines a rule with `::=`."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.split("\n"))
    return not any("::=" in line for line in lines)


def library_message(error: Exception) -> str:
    """The grammar library's error without its log prefix ("[time] file.cc:line: Check failed: (...) is false: ")."""
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", message)


# JSON schema keywords the grammar library (xgrammar 0.2) skips without a word: a schema using one would constrain
# less than it says (also uniqueItems: true, minLength/maxLength beside a pattern or format, a required name that is
# not among the same schema's properties, from an allOf, a $ref or patternProperties, and a pattern's lookaround,
# checked below). vLLM refuses schemas with features its xgrammar backend lacks in the same way
IGNORED_KEYWORDS = ("not", "if", "then", "else", "$dynamicRef", "contains", "minContains", "maxContains")
IGNORED_KEYWORDS += ("dependentRequired", "dependentSchemas")
SUBSCHEMA = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keyword(text: str) -> str | None:
    """Where a JSON schema (as text) uses a keyword the grammar library would ignore, and which ("#/properties/a
    uses 'not'"); None if it uses none (or is not JSON: the library names that)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return None

    def first(node: Any, where: str) -> str | None:
        if not isinstance(node, dict):
            return None
        used = next((keyword for keyword in IGNORED_KEYWORDS if keyword in node), None)
        if used is None and isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            used = "allOf with more than one schema"
        if used is None and isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#"):
            used = f"$ref to another document ({node['$ref']})"
        if used is None and "multipleOf" in node and node.get("type") != "integer":
            used = "multipleOf on a non-integer"
        if used is None and node.get("uniqueItems") is True:
            used = "uniqueItems"
        required, named = node.get("required"), node.get("properties")
        if used is None and isinstance(required, list) and required:  # (only its own properties' names are required)
            unlisted = [name for name in required if not isinstance(named, dict) or name not in named]
            used = f"required {unlisted[0]!r:.40} without it among its properties" if unlisted else None
        if used is None and isinstance(node.get("pattern"), str) and re.search(r"(?<!\\)\(\?<?[=!]", node["pattern"]):
            used = "a lookahead or lookbehind in its pattern"
        if used is None and ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            used = f"minLength/maxLength with a {'pattern' if 'pattern' in node else 'format'}"
        if used is not None:
            return f"{where} uses {used if ' ' in used else repr(used)}"
        children = [(node.get(key), f"{where}/{key}") for key in SUBSCHEMA]
        for key in SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                children += [(child, f"{where}/{key}/{i}") for i, child in enumerate(node[key])]
        for key in SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                children += [(child, f"{where}/{key}/{name}") for name, child in node[key].items()]
        return next((found for child, at in children if (found := first(child, at)) is not None), None)

    return first(schema, "#")
