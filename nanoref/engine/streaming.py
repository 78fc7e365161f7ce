"""`LLMEngine.stream`'s iterator: one request's text as it grows, for a notebook, driving the engine's steps itself.

A plain generator ends its request only when it is closed, and a `for` loop closes nothing: left by a `break`, an
exception or Ctrl-C in the loop's body, the generator waits where it yielded, its request queued and holding KV
blocks (a later `generate` runs that request to its end too), until the last reference to it goes; a name bound to
it, or a traceback that keeps the loop's frame, keeps it. `RequestStream` is also a context manager, so the request
ends with the block whatever ends it:

    with llm.stream("Hello", params) as pieces:
        for piece in pieces:
            print(piece.text, end="")

A stream that only a reference cycle holds is closed by the cyclic garbage collector, which runs wherever Python
allocates: in the middle of a step too, on the thread that runs it. Its abort then waits for the step's end
(`OutputProcessor.abandoned`): aborted there, its sequence lost its blocks between scheduling and the forward, and the
step failed, every request in it with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanoref.engine.output_processor import StreamPiece
from nanoref.engine.sequence import Sequence
from nanoref.utils.interrupts import held_interrupts


class RequestStream(Iterator[StreamPiece]):
    """The StreamPieces of one request's samples (LLMEngine.stream). The request is queued at the first piece, and
    ends (aborted where unfinished: its blocks go back, the other requests run on) once its last piece is taken, on
    `close()`, at the end of a `with` block around it, or when the stream is dropped."""

    def __init__(self, engine: Any, samples: list[Sequence]) -> None:
        """engine: the LLMEngine that serves the samples (not named: it imports this module)."""
        self._pieces = _pieces(engine, samples)

    def __next__(self) -> StreamPiece:
        return next(self._pieces)

    def close(self) -> None:
        """End the request now: an unfinished sample is aborted and its blocks go back (a finished one is left as it
        is). A closed stream yields nothing more."""
        self._pieces.close()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pieces(engine: Any, samples: list[Sequence]) -> Iterator[StreamPiece]:
    sent = {seq: [0, 0] for seq in samples}  # seq -> [tokens, characters] already yielded
    queued = False
    try:
        with held_interrupts():  # (a Ctrl-C while queuing is raised at the block's end: queued, and in the try)
            engine.enqueue_samples(samples)
            queued = True
        while sent:
            with engine._lock:  # (another caller's generate or step loop may have run it to its end meanwhile)
                if not all(seq.is_finished for seq in sent):
                    engine.step()
            yield from engine.output_processor.pieces(sent)
    finally:  # closed early, or a step raised: this request ends here, the others run on
        if not queued:  # (queuing raised: nothing of it is queued)
            pass
        elif engine._lock._is_owned():  # closed inside an engine call of this thread (see `abandoned`): not now
            engine.output_processor.abandoned.extend(reversed(samples))
        else:
            with held_interrupts():  # (all its samples: Ctrl-C between two aborts would leave the others queued)
                for seq in reversed(samples):  # (the last first: samples 1..n-1 may be held for sample 0's prompt)
                    engine.abort_request(seq)
