"""Tensor parallelism: the ranks' processes and groups (`tensor_parallel.py`) and the model runner as one rank of
several (`runner.py`), attached from outside the core (nanoref/llm.py)."""
