"""What makes the plain engine fast on a GPU, each attached from outside (nanoref/llm.py): decode CUDA graphs
(`cuda_graphs.py`) and the overlapped host/device loop (`overlap.py`)."""
