"""srsd-local: a local LLM runtime on llama.cpp with Semantic Retrieval Speculative Decoding."""

from .config import SamplingParams, SRSDConfig
from .engine import Engine, GenerationResult, GenerationStats, StreamEvent
from .llama.models import ModelError, resolve_model

__all__ = ["Engine", "GenerationResult", "GenerationStats", "ModelError", "SRSDConfig",
           "SamplingParams", "StreamEvent", "resolve_model"]
__version__ = "0.1.0"
