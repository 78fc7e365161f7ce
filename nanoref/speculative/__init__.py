"""Speculative decoding, attached from outside (nanoref/llm.py): guess k tokens cheaply, check them in one forward.

A decode step reads every weight once to make one token per sequence; reading them once to check k + 1 tokens
costs about the same. So a proposer guesses k tokens per sequence (`proposers.py`: n-gram prompt lookup, or a
small draft model), one target forward scores the last token and the k guesses at once (a varlen step over the
paged history), and the acceptance rule (`acceptance.py`) keeps the longest run the target agrees with plus one
token of its own, without changing the distribution the target samples from. `loop.py` runs the step in place of
the engine's plain one, `runner.py` gives a draft model its own KV cache beside the target's.
"""
