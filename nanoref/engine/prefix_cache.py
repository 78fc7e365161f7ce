"""Emptying the prefix cache (vLLM's `LLM.reset_prefix_cache`): no later request reads K/V computed before it.

Benchmarks call it between timed runs, so that a run that replays earlier prompts times their prefill again; after a
change of weights (a new checkpoint loaded in place) it keeps requests from reading K/V the old weights made.
"""

from __future__ import annotations

import warnings

from nanoref.engine.block_manager import BlockManager


def reset_prefix_cache(manager: BlockManager) -> int:
    """Forget every cached block of `manager` (nanoref's forward's, an exercise forward's, every cache salt's) -> 0;
    or, as vLLM does, change nothing while a request still holds blocks (its blocks would publish their hashes again
    as its steps fill them, chained to hashes the reset cleared) -> the number of blocks held. The caller holds the
    engine's lock (no step may run meanwhile) and reports a refusal (`warn_blocks_held`)."""
    if manager.used_block_ids:
        return len(manager.used_block_ids)
    for block in manager.blocks:  # every block is free (ref_count 0): none holds K/V that a request still reads
        block.hash, block.token_ids, block.forward = -1, [], None
    manager.hash_to_block_id.clear()
    manager.forward_tables.clear()
    return 0


def check_reset_options(reset_running_requests: object, reset_connector: object) -> None:
    """vLLM's two options of reset_prefix_cache, which nanoref does not take: it preempts no running request to
    reset (the overlapped loop keeps a step on the device between two calls of step: a preemption then would pull
    blocks from under it), and has no KV connector (ValueError naming one that is not False, and why)."""
    for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
        if value is not False:
            raise ValueError(f"{name} is not supported by nanoref's reset_prefix_cache (only False): {WHY_NOT[name]}")


WHY_NOT = {
    "reset_running_requests": "nanoref does not preempt running requests to reset the cache; reset it once they "
    "finish, or abort them first",
    "reset_connector": "nanoref has no KV connector",
}


def warn_blocks_held(num_blocks: int, stacklevel: int = 3) -> None:
    """The RuntimeWarning of a refused reset (vLLM logs one): stacklevel 3 names the caller of the method that calls
    this."""
    warnings.warn(
        f"reset_prefix_cache: unfinished requests still hold KV blocks ({num_blocks}); nothing was reset (call it "
        "once they finish or are aborted)",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
