"""The engine layer: the token-only generation loop and what it emits."""

from .engine import Engine, GenerationResult, StreamEvent, collect
from .stats import GenerationStats
from .verify import VerifyReport

__all__ = ["Engine", "GenerationResult", "GenerationStats", "StreamEvent", "VerifyReport",
           "collect"]
