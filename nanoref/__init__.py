"""nanoref: a small, tested, notebook-taught reference of a Nano-vLLM-style inference engine."""

from nanoref.engine.metrics import EngineMetrics, RequestMetrics, StepRecord
from nanoref.llm import DEFAULT_MODEL, LLM, LoRARequest
from nanoref.sampling_params import SamplingParams, StructuredOutputsParams
from nanoref.utils.loader import ModelFolderError
from nanoref.utils.tracing import trace_shapes
from nanoref.utils.version import __version__

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "LoRARequest",
    "EngineMetrics",
    "ModelFolderError",
    "RequestMetrics",
    "SamplingParams",
    "StepRecord",
    "StructuredOutputsParams",
    "__version__",
    "trace_shapes",
]
