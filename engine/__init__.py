"""Inference Lab's engine: a real, instrumented LLM inference library with a typed event stream. No Qt here."""

__version__ = "0.1.0"
