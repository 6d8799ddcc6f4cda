"""Serving language models: the engine (continuous batching over cache slots, each request its
own sampling rules and key), the standard-input requests of `dense-armor serve`, and an
OpenAI-compatible HTTP server on the engine (`dense_armor.serving.http`, the `serve` extra)."""

from .engine import Completion, Event, QueueFull, Sampling, Server
from .requests import read_requests

__all__ = ["Completion", "Event", "QueueFull", "Sampling", "Server", "read_requests"]
