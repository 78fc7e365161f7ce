"""A request's explicit state: its tokens, how many have K/V in the cache, and its blocks."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import Any

import torch

from nanoref.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued for prefill (new, or preempted and to be recomputed)
    RUNNING = auto()  # prefilled; one token per decode step
    FINISHED = auto()


class Sequence:
    _ids = count()  # the ids of sequences built without one (tests, exercises); an engine numbers its own

    def __init__(
        self, token_ids: list[int], sampling_params: SamplingParams, block_size: int, seq_id: int | None = None
    ) -> None:
        """seq_id: the id its engine gives it (each engine counts from 0); None: the next of a process-wide count."""
        self.seq_id = next(Sequence._ids) if seq_id is None else seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.table_row = -1  # this sequence's row of the block manager's BlockTables while it holds blocks
        # tokens whose K/V is in the cache; the rest still need a forward pass
        self.num_computed_tokens = 0
        # tokens that a step is about to compute (set by the scheduler, consumed by postprocess)
        self.num_scheduled_tokens = 0
        # prompt tokens found in the prefix cache when first admitted (vLLM's num_cached_tokens)
        self.num_prefix_hit_tokens = 0
        # leading blocks whose hash the block manager has registered
        self.num_hashed_blocks = 0
        # the block manager's forward epoch at allocation: its blocks are published only while it is current
        self.forward_epoch = 0
        self.num_preemptions = 0
        # a seeded request draws its sampling noise from its own generator (set by the engine)
        self.generator: torch.Generator | None = None
        # what its K/V depends on besides the tokens (None: nothing); the prefix cache shares blocks only between
        # sequences of equal salt (vLLM's cache_salt; a per-request change of the weights sets it too)
        self.cache_salt: object = None
        # why it finished: "stop" (EOS or a stop string), "length" (max_tokens or max_model_len) or "abort"; None
        # while it runs
        self.finish_reason: str | None = None
        # what ended it: the stop_token_ids entry or the stop string ("stop"); None for EOS, length and abort
        self.stop_reason: int | str | None = None
        self.output: Any = None  # what the output stage keeps for it (engine/output_processor.py's SampleOutput)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold every token's K/V."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, index: int) -> list[int]:
        """The token ids that block `index` of this sequence holds (the last block may be partial)."""
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        if self.is_finished:  # its blocks went back, and with them its cached K/V: its token counts tell its story
            state = f"FINISHED ({self.finish_reason}), tokens={self.num_tokens}: {self.num_prompt_tokens} prompt + "
            return f"Sequence(id={self.seq_id}, {state}{self.num_completion_tokens} completion)"
        state = f"{self.status.name}, tokens={self.num_tokens}, computed={self.num_computed_tokens}"
        return f"Sequence(id={self.seq_id}, {state}, blocks={self.block_table})"
