"""srsd-local: a local LLM runtime on llama.cpp with Semantic Retrieval Speculative Decoding."""

from .config import SamplingParams, SRSDConfig
from .engine import Engine, GenerationResult, GenerationStats, StreamEvent, VerifyReport
from .llama.models import ModelEntry, ModelError, list_models, pull_model, resolve_model
from .spec.sampling import TokenLogprob

__all__ = ["Engine", "GenerationResult", "GenerationStats", "ModelEntry", "ModelError",
           "SRSDConfig", "SamplingParams", "StreamEvent", "TokenLogprob", "VerifyReport",
           "list_models", "pull_model", "resolve_model"]
__version__ = "0.1.0"
