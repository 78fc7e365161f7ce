"""What `enable_lora` attaches to the engine, through the hooks the core offers (engine/hooks.py).

- A request's adapter is read and checked when the request is made (`bind`), before anything is queued, enters
  the host cache when the request is queued (`commit`), and becomes the `cache_salt` of each of its sequences:
  the prefix cache shares K/V only between sequences of equal salt, so a prompt under adapter A never reads K/V
  computed under B or under the base model. The salt is the
  `LoRARequest` itself (name, id and folder), which is also how a step finds a sequence's adapter (`adapter_of`);
  a request with a salt of its own already (prompt logprobs) keeps it beside the adapter (`SaltedAdapter`).
- The scheduler admits a waiting sequence only while the running and admitted sequences name at most `max_loras`
  adapters (`can_admit`): every step's adapters then fit in the device slots. Base-model requests always fit.
- Before every forward of the target model (prefill, decode, a speculative verify step), `set_step_slots` gives
  the step's adapters their slots (`LoRAManager.assign_slots`: LRU) and writes every token row's slot into the
  manager's `row_slots`: a prefill sequence's slot repeated over its chunk's tokens (`cu_seqlens_q`), a decode
  sequence's over its `decode_query_len` rows, -1 for base-model rows. A draft model runs without adapters (its
  proposals are only guesses: the target, with the adapter, decides every token).
- On CUDA the decode graphs are recorded twice (`GraphsByRowMix`): with the delta, for steps where any row has an
  adapter, and without it, for steps of base-model rows alone, which then cost what they cost without LoRA (a
  graph replays what it recorded: one recorded with the delta computes it for every row, adapter or not).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any, NamedTuple
from weakref import WeakKeyDictionary, WeakSet, ref

import numpy as np

from nanoref.engine.hooks import StepHook
from nanoref.engine.kv_budget import hold_before_kv_cache
from nanoref.engine.sequence import Sequence
from nanoref.engine.step_inputs import StepInputs
from nanoref.lora.manager import LoRAManager
from nanoref.lora.request import LoRARequest
from nanoref.utils.weak import WeakBoundMethod


class SaltedAdapter(NamedTuple):
    """The cache salt of a sequence that had one of its own before its adapter was bound (prompt logprobs': the
    cache shares none of its prompt's blocks with another request), kept beside the adapter."""

    salt: object
    adapter: LoRARequest


def adapter_of(seq: Sequence) -> LoRARequest | None:
    """The adapter a sequence runs under (None: the base model)."""
    salt = seq.cache_salt
    if isinstance(salt, SaltedAdapter):
        return salt.adapter
    return salt if isinstance(salt, LoRARequest) else None


def max_forward_rows(config) -> int:
    """The most token rows one forward can have: a prefill step's tokens, or a decode (verify) step's rows."""
    spec = config.speculative_config
    query_len = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    return max(config.max_num_batched_tokens, config.max_num_seqs * query_len)


class LoRAHooks:
    """The adapters of one engine: the manager on its model (built by `attach`), the admission rule, requests'
    adapters. Made by nanoref/llm.py for a config with enable_lora."""

    def __init__(self, config) -> None:
        self.config = config
        self.max_loras = config.max_loras
        self.manager: LoRAManager | None = None  # (once the runner's model exists)
        # the runner whose model has the slots, weakly: the runner holds this object's step hook, and a strong
        # reference back would keep a dropped engine's model and KV cache alive until a cyclic collection
        self.runner: ref | None = None
        self.rows_are_base = True  # row_slots holds -1 everywhere (a base-only step has nothing to write)
        # the requests queued per adapter name, over the engine's life
        self.num_requests: dict[str, int] = {}
        # each adapter's sequences (weakly: samples of a call that failed before queuing them just go away)
        self.bound: dict[int, WeakSet[Sequence]] = {}
        self.bound_lock = threading.Lock()  # (a server's request thread queues while the engine's thread asks)
        # each request's adapter from `bind` (made) to `commit` (queued), by its sample 0 (weakly: a request never
        # queued takes its adapter with it)
        self.staged: WeakKeyDictionary[Sequence, Any] = WeakKeyDictionary()

    # -- the runner's hook ----------------------------------------------------------------------
    def attach(self, runner) -> StepHook:
        """RunnerHooks.attach_before_kv_cache: slots on the runner's model, filled before each of its forwards. They
        exist before the KV cache is sized (as vLLM sets LoRA up before it measures the memory left for the cache):
        their bytes count as used and the cache gets what they leave (on a GPU, the largest prefill measured for the
        cache's budget runs their delta too)."""
        c = self.config
        self.runner = ref(runner)
        self.manager = LoRAManager(
            runner.model,
            c.hf_config,
            max_loras=c.max_loras,
            max_lora_rank=c.max_lora_rank,
            max_cpu_loras=c.max_cpu_loras,
            max_num_tokens=max_forward_rows(c),
        )
        self.manager.in_flight = WeakBoundMethod(self.in_flight)  # (weakly: the hooks hold the manager)
        slot_bytes = sum(t.nbytes for slots in self.manager.slots.values() for t in slots.lora_a + slots.lora_b)
        what = f"the LoRA slots (max_loras={c.max_loras}, max_lora_rank={c.max_lora_rank})"
        hold_before_kv_cache(runner, slot_bytes, what, "lower max_loras or max_lora_rank")
        return self.set_step_slots

    def set_step_slots(self, seqs: list[Sequence], step: StepInputs) -> None:
        """Every token row's adapter slot for this forward, into the manager's row_slots."""
        adapters = [adapter_of(seq) for seq in seqs]
        used = [adapter for adapter in adapters if adapter is not None]
        self.manager.base_only = not used
        if not used and self.rows_are_base:
            return
        slots = self.manager.assign_slots(used)  # {lora_int_id: slot}
        seq_slots = np.array([-1 if a is None else slots[a.lora_int_id] for a in adapters], dtype=np.int64)  # (B,)
        rows_per_seq = np.diff(step.arrays["cu_seqlens_q"]) if step.is_prefill else step.decode_query_len
        self.manager.set_row_slots(np.repeat(seq_slots, rows_per_seq))  # (N,)
        self.rows_are_base = not used

    def decode_graphs(self, runner, make: Callable[[], Any]) -> Any:
        """The runner's decode replayer: for the runner whose model has the slots (`attach`), `make()` recorded with
        and without the delta (see GraphsByRowMix); for another (a speculative draft's), `make()` once."""
        if self.manager is None or self.runner is None or runner is not self.runner():
            return make()
        return GraphsByRowMix(self.manager, make)

    # -- the scheduler's hook -------------------------------------------------------------------
    def can_admit(self, seq: Sequence, running: Iterable[Sequence], scheduled: list[Sequence]) -> bool:
        """EngineHooks.can_admit: at most max_loras distinct adapters among the running and admitted sequences."""
        if adapter_of(seq) is None:
            return True
        names = {a.lora_int_id for s in chain(running, scheduled) if (a := adapter_of(s)) is not None}
        return len(names) <= self.max_loras

    # -- requests -------------------------------------------------------------------------------
    def bind(self, samples: list[Sequence], lora_request: LoRARequest) -> None:
        """A request's sequences run under this adapter, read and checked now (LoRAAdapterError, ValueError), and
        keep their own prefix cache. The host cache is not touched until the request is queued (`commit`): a
        request that is never queued (refused, or the next prompt of its call refused) evicts no other adapter."""
        adapter = self.manager.read_lora(lora_request)
        for seq in samples:  # (a salt the request has already is kept: its K/V stays apart as it asked)
            seq.cache_salt = lora_request if seq.cache_salt is None else SaltedAdapter(seq.cache_salt, lora_request)
        self.staged[samples[0]] = adapter

    def commit(self, samples: list[Sequence]) -> None:
        """A request is being queued: its adapter (the one `bind` checked) into the host cache, kept there while
        the request runs (`in_flight`). Call with the engine's lock held."""
        adapter = self.staged.pop(samples[0], None)
        lora_request = adapter_of(samples[0])
        if lora_request is None:
            return
        self.manager.add_lora(lora_request, adapter=adapter)
        with self.bound_lock:
            self.bound.setdefault(lora_request.lora_int_id, WeakSet()).update(samples)

    def unload(self, lora_int_id: int) -> bool:
        return self.manager.remove_lora(lora_int_id)

    def in_flight(self) -> set[int]:
        """The adapters that sequences not finished yet run under (the manager keeps them on the host)."""
        with self.bound_lock:
            for lora_int_id, seqs in list(self.bound.items()):
                for seq in [seq for seq in seqs if seq.is_finished]:
                    seqs.discard(seq)
                if not seqs:
                    del self.bound[lora_int_id]
            return set(self.bound)

    def count(self, seq: Sequence) -> None:
        """A queued request (its sample 0): counted under its adapter's name (a base-model one is not counted)."""
        adapter = adapter_of(seq)
        if adapter is not None:
            self.num_requests[adapter.lora_name] = self.num_requests.get(adapter.lora_name, 0) + 1


class GraphsByRowMix:
    """A decode replayer of two recordings, picked per step: `base` (W alone) when the step's rows are all
    base-model rows, `mixed` (W plus each row's delta) otherwise. Made by `LoRAHooks.decode_graphs`."""

    def __init__(self, manager: LoRAManager, make: Callable[[], Any]) -> None:
        """make: records one set of decode graphs (`DecodeGraphs(runner)`; nanoref/llm.py passes it)."""
        self.manager = manager
        self.mixed = make()
        manager.record_base_only = True
        try:
            self.base = make()
        finally:
            manager.record_base_only = False

    def covers(self, batch: int) -> bool:
        return self.mixed.covers(batch)

    def run(self, input_ids, positions):
        """As DecodeGraphs.run, through the recording for this step's rows (the step hook set `base_only`)."""
        return (self.base if self.manager.base_only else self.mixed).run(input_ids, positions)

    def __getattr__(self, name: str) -> Any:  # buckets, buffers, graphs: the mixed recording's
        return getattr(self.mixed, name)


def check_lora_request(lora_request: object, enabled: bool) -> LoRARequest | None:
    if lora_request is None:
        return None
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
    if not enabled:
        raise ValueError(
            f"lora_request names the adapter {lora_request.lora_name!r}, but this engine has no adapters: "
            "use LLM(..., enable_lora=True)"
        )
    return lora_request


def lora_request_list(lora_request: object, num_prompts: int, enabled: bool) -> list[LoRARequest | None]:
    """generate's lora_request: one for every prompt, or a list with one per prompt (None: the base model)."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts")
        requests = [check_lora_request(r, enabled) for r in lora_request]
        by_id: dict[int, LoRARequest] = {}
        for index, request in enumerate(requests):  # (checked here: each is queued only after all are checked)
            if request is not None and by_id.setdefault(request.lora_int_id, request) != request:
                known = by_id[request.lora_int_id]
                raise ValueError(
                    f"prompt {index}: lora_int_id {request.lora_int_id} names {request.lora_name!r} "
                    f"({request.lora_path}), but an earlier prompt's names {known.lora_name!r} ({known.lora_path})"
                )
        return requests
    return [check_lora_request(lora_request, enabled)] * num_prompts
