"""Freezing the start-up heap, in the processes nanoref owns: the server's, the engine process, tensor-parallel workers.

Python's cyclic garbage collector runs a full collection (generation 2) now and then, and a full collection walks
every tracked object of the process: after importing torch and transformers and building a model that is a few
hundred thousand objects, which live until the process ends and are never garbage. Meanwhile the process stops.
Measured on this project's 2-core CPU machine with the built-in model (benchmarks/serving.py, 64 streams): a full
collection while it served took 212-310 ms in the server's process (244,000 objects) and 95 ms in the engine's,
stalling every stream and every step; with the start-up heap frozen, 0.1 ms. A serving process allocates per
request and per token, so full collections keep coming.

`gc.freeze()` moves every object alive at that moment to a permanent generation that collections no longer walk
(vLLM's API server and engine core do the same after start-up). What those objects refer to is still freed by
reference counting; a cycle among them that became garbage later would never be collected, so collect first, and
freeze only what start-up made: the model, the tokenizer, the app. Only in a process nanoref owns: the library
never changes the garbage collector of the caller's process (offline `LLM` leaves it alone; its tensor-parallel
workers, nanoref's processes, freeze theirs: a worker that pauses stalls every rank at the next collective).
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect the garbage start-up left, then freeze everything still alive -> how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
