"""Cost estimate of an OpenAI-style request body, in tokens, before it runs.

* **prefill (prompt) tokens** — by a named, pluggable estimator (``SidecarSettings.
  prompt_estimator``). The default ``chars4`` counts the characters of every text the model reads
  (``prompt`` as a string or list of strings; each ``messages[].content`` as a string or a list of
  ``{"type": "text", "text": ...}`` parts) and charges ``ceil(chars / 4) + 4`` per message
  (OpenAI's rule of thumb: ~4 characters of English per token, a few tokens of chat framing). It is
  an estimate; settlement corrects it with the usage the backend reports.
* **decode tokens** — ``max_completion_tokens`` or else ``max_tokens`` (an integer ``>= 1`` and
  ``<= max_decode_tokens``), or ``default_decode_tokens`` when neither is set.

A bad field raises :class:`EstimateError` naming it (the proxy answers ``400`` with ``param``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

CHARS_PER_TOKEN: Final = 4
MESSAGE_OVERHEAD_TOKENS: Final = 4


class EstimateError(ValueError):
    """A body field the estimate needs is invalid; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Estimate:
    prefill_tokens: int
    decode_tokens: int


PromptEstimator = Callable[[Mapping[str, object]], int]


def _text_chars(param: str, content: object) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        chars = 0
        for part in content:
            if isinstance(part, str):
                chars += len(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
            else:
                raise EstimateError(param, f"{param}: must be a string or a list of parts")
        return chars
    raise EstimateError(
        param, f"{param}: must be a string or a list (got {type(content).__name__})"
    )


def chars4(body: Mapping[str, object]) -> int:
    """``ceil(chars / 4)`` over the prompt, plus 4 framing tokens per chat message."""
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise EstimateError("messages", "messages: must be a list")
        tokens = 0
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise EstimateError(f"messages[{i}]", f"messages[{i}]: must be an object")
            chars = _text_chars(f"messages[{i}].content", message.get("content"))
            tokens += math.ceil(chars / CHARS_PER_TOKEN) + MESSAGE_OVERHEAD_TOKENS
        return tokens
    return math.ceil(_text_chars("prompt", body.get("prompt")) / CHARS_PER_TOKEN)


ESTIMATORS: Final[dict[str, PromptEstimator]] = {"chars4": chars4}
"""Prompt estimators by name; add one here to make it selectable."""


def decode_tokens(body: Mapping[str, object], default: int, cap: int) -> int:
    for param in ("max_completion_tokens", "max_tokens"):
        value = body.get(param)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(param, f"{param}: must be an integer >= 1 (got {value!r})")
        if value > cap:
            raise EstimateError(param, f"{param}: must be <= {cap} (got {value})")
        return value
    return default


def estimate(
    body: Mapping[str, object], estimator: PromptEstimator, default_decode: int, max_decode: int
) -> Estimate:
    return Estimate(estimator(body), decode_tokens(body, default_decode, max_decode))
