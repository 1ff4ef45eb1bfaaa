"""Cost estimate of an OpenAI-style request body, in tokens, before it runs.

* **prefill (prompt) tokens** — by a named, pluggable estimator (``SidecarSettings.
  prompt_estimator``). The default ``chars4`` counts the characters of every text the model reads
  and charges ``ceil(chars / 4)`` (OpenAI's rule of thumb: ~4 characters of English per token):

  - ``prompt`` (legacy completions) as a string or a list of strings — or as token IDs, a
    list of integers or a list of lists of integers, counted one token per ID (exact: an ID is
    one token whatever the tokenizer). A token ID is an integer in ``0..MAX_TOKEN_ID``
    (``2**31 - 1``: vLLM's IDs are 32-bit); a batch (a list of strings or of lists) holds at
    most :data:`MAX_BATCH_INPUTS` (2048) prompts; the number of IDs is bounded by the body's
    ``max_json_values``. A bad element is named in the message (``prompt[1][2]: ...``);
  - each ``messages[i]``: its ``content`` (a string, or a list of parts whose ``text`` is
    counted, and :data:`IMAGE_TOKENS` (1,445) for each image part: a 400 KB base64 image was
    ~4 tokens, the message's framing, while a server charges it hundreds to thousands), its
    ``name``, and its ``tool_calls`` / ``function_call`` (function names and arguments:
    counted as their compact JSON, the text a server renders into the prompt), plus
    :data:`MESSAGE_OVERHEAD_TOKENS` (4) of chat framing per message;
  - ``tools``, ``functions`` (their names, descriptions and JSON-schema parameters),
    ``response_format`` (a JSON schema) and ``tool_choice``: counted as their compact JSON
    (servers render tool and schema definitions into the prompt as JSON text).

  It is an estimate; settlement corrects it with the usage the backend reports.
* **decode tokens** — the larger of ``max_completion_tokens`` and ``max_tokens`` (each, when
  set, an integer ``>= 1`` and ``<= max_decode_tokens``), or ``default_decode_tokens`` when
  neither is set, **per generated sequence**. The larger, because servers differ on which one
  rules: vLLM's chat endpoint takes ``max_completion_tokens`` when set, its legacy completions
  endpoint knows only ``max_tokens`` (``max_completion_tokens`` is an ignored extra field
  there), so ``max_tokens`` 8000 with ``max_completion_tokens`` 1 generates up to 8000; a
  reservation must cover what runs, and settlement returns what did not.
  ``decode = per_choice * max(n, best_of)``. ``n`` (choices returned) and
  ``best_of`` (sequences generated, the best ``n`` returned: legacy completions) are integers in
  ``1..MAX_CHOICES`` (128, OpenAI's limit for ``n``), with ``best_of >= n``. The prompt is
  charged **once**, whatever ``n`` and ``best_of``: vLLM (and OpenAI's usage) prefill a prompt
  once and fork its sequences from the shared prefix (``prompt_tokens`` is reported once, the
  ``completion_tokens`` of all sequences summed), so each extra sequence costs decode work and
  its own KV for its decoded tokens only — which is what ``prefill + n * decode`` reserves.
  A batch of prompts (legacy completions: ``prompt`` as a list of strings, or a list of lists
  of token IDs) generates ``max(n, best_of)`` sequences **per prompt**:
  ``decode = per_choice * max(n, best_of) * prompts`` (and the KV of those decoded tokens,
  which the scheduler reserves from ``prefill + decode``); the prefill is every prompt's.

**Embeddings** (``/v1/embeddings``, :func:`estimate_embeddings`) cost prefill only: decode is
0. ``input`` takes the same four shapes as ``prompt`` (a string, a list of strings, a list of
token IDs, a list of lists of token IDs) and every input counts — text by the estimator, IDs
one token each — so ``prefill`` is the sum over the inputs; ``dimensions`` (an integer in
``1..MAX_EMBEDDING_DIMENSIONS``) and ``encoding_format`` (``float`` or ``base64``) are checked
here too, so a bad one is refused before admission.

A bad field raises :class:`EstimateError` naming it (the proxy answers ``400`` with ``param``).
The estimate walks only what its caller bounded: the proxy checks a body's nesting depth and
number of JSON values (:func:`check_json_shape`) before estimating it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

CHARS_PER_TOKEN: Final = 4
MESSAGE_OVERHEAD_TOKENS: Final = 4
MAX_CHOICES: Final = 128
"""Largest ``n`` and ``best_of`` accepted (OpenAI's documented maximum for ``n``)."""
MAX_TOKEN_ID: Final = 2**31 - 1
"""Largest token ID accepted in a ``prompt`` or ``input`` (vLLM's token IDs are 32-bit)."""
MAX_BATCH_INPUTS: Final = 2048
"""Most prompts (``prompt``) or inputs (``input``) in one request's batch: OpenAI's limit for an
embeddings ``input`` array."""
MAX_EMBEDDING_DIMENSIONS: Final = 16384
"""Largest ``dimensions`` accepted for an embedding (OpenAI's largest model has 3,072)."""
EMBEDDING_ENCODINGS: Final = ("float", "base64")
"""``encoding_format`` values of an embeddings request (OpenAI's; the SDK asks for base64)."""
IMAGE_TOKENS: Final = 1445
"""Prompt tokens charged per image part: OpenAI's most for one image at ``detail`` ``high`` or
``auto`` (scaled into 2048 x 2048, its short side to 768: at most 2 x 4 tiles of 512 px, 170
tokens each, plus 85). The sidecar does not decode images; settlement corrects the estimate
with the usage the server reports (vLLM's models differ: 576 for LLaVA-1.5, thousands for
dynamic-resolution ones)."""
IMAGE_PART_TYPES: Final = frozenset({"image_url", "input_image", "image_embeds", "image_pil"})
"""Content part types that carry an image (OpenAI's ``image_url``, its Responses API's
``input_image``, vLLM's ``image_embeds`` and ``image_pil``); a part with an ``image_url`` key
counts too."""
STRUCTURED_PROMPT_FIELDS: Final = ("tools", "functions", "response_format", "tool_choice")
"""Top-level fields whose text a server renders into the prompt (counted as compact JSON)."""
MAX_JSON_DEPTH: Final = 64
"""Default nesting limit of a request body (``SidecarSettings.max_json_depth``): deep enough for
any JSON schema in ``tools`` or ``response_format`` (the body, a tool, its ``parameters`` and a
few levels of nested properties are ~10), far below the ~1,000 levels where the parser fails."""
MAX_JSON_VALUES: Final = 20_000
"""Default limit on the JSON values of a request body (``SidecarSettings.max_json_values``;
counted as :func:`check_raw_values` says): a chat of 1,000 messages of role and content is
~3,000; 128 tools with schemas of a dozen properties ~10,000. It bounds the event-loop time a
body costs before admission: the parse (~0.1-0.4 µs per value) and the estimate, which walks
messages and parts one by one (a 1 MiB body of 234,000 empty messages took ~0.2 s)."""


class EstimateError(ValueError):
    """A body field the estimate needs is invalid; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class BodyShapeError(ValueError):
    """The body nests deeper or holds more JSON values than allowed; ``rule`` names the limit
    (``max_json_depth`` or ``max_json_values``)."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True, slots=True)
class Estimate:
    prefill_tokens: int
    decode_tokens: int
    """Over all generated sequences: ``per_choice * max(n, best_of) * prompts``."""


PromptEstimator = Callable[[Mapping[str, object]], int]


_CONTAINERS: Final = (dict, list)
"""The parsed JSON containers, as a tuple: ``isinstance(v, dict | list)`` written in a loop
builds the union at every element (about twice the cost of the check)."""
_JSON_STRING: Final = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
"""A JSON string literal (escapes included) — or, if it never closes, the rest of the text from
its opening quote: the quantifiers are possessive (no backtracking), so a match at a quote
always succeeds and consumes to the closing quote or the end. A scan over the text therefore
never retries a string from a later quote (which made an unclosed string full of escaped
quotes cost time quadratic in its length), and reads each byte once."""


class NotUtf8Error(ValueError):
    """The body is not UTF-8 (RFC 8259 §8.1: JSON exchanged between systems is UTF-8)."""


def utf8_text(raw: bytes) -> str:
    """``raw`` decoded as UTF-8, or :class:`NotUtf8Error`. JSON between systems must be UTF-8
    (RFC 8259 §8.1); ``json.loads`` of bytes would also accept UTF-16 and UTF-32 (detected from
    NUL bytes among the first four), which :func:`check_raw_values` would count wrongly (it
    reads the bytes as UTF-8), so such a body is refused before any counting, as is one with a
    NUL among its first four bytes (no JSON text starts with NUL: UTF-16/32 ASCII text is
    valid UTF-8 byte by byte). Parse the returned text, not the bytes."""
    if b"\x00" in raw[:4]:
        raise NotUtf8Error(
            "the body must be JSON encoded as UTF-8 (RFC 8259 section 8.1); it starts with NUL "
            "bytes (UTF-16 or UTF-32?)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotUtf8Error(
            f"the body must be JSON encoded as UTF-8 (RFC 8259 section 8.1); byte {exc.start} "
            "is not valid UTF-8"
        ) from None


def _structural(raw: bytes) -> int:
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def check_raw_values(raw: bytes, max_values: int) -> int:
    """Raise :class:`BodyShapeError` (``max_json_values``) if the JSON text ``raw`` (UTF-8:
    :func:`utf8_text`) holds more than ``max_values`` values, **before** it is parsed: the
    parser's time grows with the values (~0.1-0.4 µs each for numbers and containers, so 1 MiB
    of ``[]`` costs ~0.15 s of the event loop, and a thread would not help: the parser holds
    the GIL).

    Values are counted as ``1 + commas + opening brackets`` outside string literals — at least
    the number of values (each array element or object member after a container's first adds a
    comma, each container a bracket). In two steps, each linear in the size of ``raw`` (~15 ms
    per MiB at worst): (1) the same count over the whole text, strings included, is an upper
    bound (``bytes.count``, ~1 ms per MiB): at most ``max_values`` passes at once (a text of
    fewer bytes than ``max_values`` passes uncounted: each comma or bracket is one byte);
    (2) otherwise the string literals are cut out in one left-to-right regex pass
    (:data:`_JSON_STRING`, at most ``2 * max_values + 1`` of them: a body with more strings
    than twice its values cannot be JSON of at most ``max_values`` values — each string is an
    object key or a value, and each value has at most one key) and the count is exact.

    A text that is not JSON is not refused here unless its count is over: an unclosed string
    runs to the end of the text, so the count is that of the JSON parser's own reading up to
    where it fails, and the parser (linear) answers it.

    Returns the opening brackets of ``raw``, strings included: an upper bound of the parsed
    body's nesting depth (each level deeper opens one more container). When they are at most
    ``max_json_depth`` the body needs no walk (:func:`check_json_shape`): its values are bounded
    here already (the count is never below the parsed body's values) and it cannot nest
    deeper than its brackets."""
    brackets = raw.count(b"[") + raw.count(b"{")
    # A byte is at most one comma or bracket: a text shorter than the limit is within it.
    if len(raw) < max_values or raw.count(b",") + brackets + 1 <= max_values:
        return brackets
    message = f"the body holds over {max_values} JSON values"
    max_strings = 2 * max_values
    outside, strings = _JSON_STRING.subn(b"", raw, count=max_strings + 1)
    if strings > max_strings or _structural(outside) > max_values:
        raise BodyShapeError("max_json_values", message)
    return brackets


def check_json_shape(body: object, max_depth: int, max_values: int) -> None:
    """Raise :class:`BodyShapeError` if ``body`` (parsed JSON) nests containers more than
    ``max_depth`` levels deep (the body itself is level 1) or holds more than ``max_values``
    values in all. Walks one nesting level at a time and stops as soon as a limit is passed, so
    its cost is bounded by ``max_values`` whatever the body (a level's children are gathered
    with C-level ``list.extend``)."""
    level: list[object] = [body]
    depth = 0
    count = 1
    while level:
        containers: list[dict[str, object] | list[object]] = [
            v for v in level if isinstance(v, _CONTAINERS)
        ]
        if not containers:
            return
        depth += 1
        if depth > max_depth:
            raise BodyShapeError(
                "max_json_depth", f"the body nests JSON over {max_depth} levels deep"
            )
        children: list[object] = []
        for container in containers:
            count += len(container)
            if count > max_values:
                raise BodyShapeError(
                    "max_json_values", f"the body holds over {max_values} JSON values"
                )
            children.extend(container.values() if isinstance(container, dict) else container)
        level = children


def _content(param: str, content: object) -> tuple[int, int]:
    """``(characters of text, image parts)`` of a message's ``content``: a string, or a list
    of parts (strings, ``{"type": "text", "text": ...}``, image parts: see
    :data:`IMAGE_PART_TYPES`; other parts count nothing)."""
    if content is None:
        return 0, 0
    if isinstance(content, str):
        return len(content), 0
    if isinstance(content, list):
        chars = images = 0
        for part in content:
            if isinstance(part, str):
                chars += len(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
                elif part.get("type") in IMAGE_PART_TYPES or "image_url" in part:
                    images += 1
            else:
                raise EstimateError(param, f"{param}: must be a string or a list of parts")
        return chars, images
    raise EstimateError(
        param, f"{param}: must be a string or a list (got {type(content).__name__})"
    )


def _json_chars(value: object) -> int:
    """Characters of ``value`` as compact JSON (non-ASCII kept as is, not ``\\u`` escaped)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _structured_chars(body: Mapping[str, object]) -> int:
    """Characters of the tool, function and schema definitions (see the module docstring)."""
    chars = 0
    for param in STRUCTURED_PROMPT_FIELDS:
        value = body.get(param)
        if value is None:
            continue
        if param in ("tools", "functions") and not isinstance(value, list):
            raise EstimateError(param, f"{param}: must be a list")
        if param == "response_format" and not isinstance(value, Mapping):
            raise EstimateError(param, f"{param}: must be an object")
        if param == "tool_choice" and not isinstance(value, str | Mapping):
            raise EstimateError(param, f"{param}: must be a string or an object")
        chars += len(value) if isinstance(value, str) else _json_chars(value)
    return chars


def _message_chars(i: int, message: Mapping[str, object]) -> tuple[int, int]:
    """``(characters, image parts)`` of ``messages[i]``."""
    content = message.get("content")
    if type(content) is str:  # the common message: no parameter name to build for an error
        chars, images = len(content), 0
    else:
        chars, images = _content(f"messages[{i}].content", content)
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise EstimateError(f"messages[{i}].name", f"messages[{i}].name: must be a string")
        chars += len(name)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise EstimateError(
                f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: must be a list"
            )
        chars += _json_chars(tool_calls)
    function_call = message.get("function_call")
    if function_call is not None:
        if not isinstance(function_call, Mapping):
            raise EstimateError(
                f"messages[{i}].function_call", f"messages[{i}].function_call: must be an object"
            )
        chars += _json_chars(function_call)
    return chars, images


def chars4(body: Mapping[str, object]) -> int:
    """``ceil(chars / 4)`` over every text the model reads, plus 4 framing tokens per chat
    message and :data:`IMAGE_TOKENS` per image part (see the module docstring for what
    counts)."""
    structured = _structured_chars(body)
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise EstimateError("messages", "messages: must be a list")
        tokens = math.ceil(structured / CHARS_PER_TOKEN)
        for i, message in enumerate(messages):
            if type(message) is not dict and not isinstance(message, Mapping):  # (an ABC check)
                raise EstimateError(f"messages[{i}]", f"messages[{i}]: must be an object")
            chars, images = _message_chars(i, message)
            tokens += math.ceil(chars / CHARS_PER_TOKEN) + images * IMAGE_TOKENS
            tokens += MESSAGE_OVERHEAD_TOKENS
        return tokens
    chars, token_ids, _ = _inputs(body.get("prompt"))
    return math.ceil((chars + structured) / CHARS_PER_TOKEN) + token_ids


ESTIMATORS: Final[dict[str, PromptEstimator]] = {"chars4": chars4}
"""Prompt estimators by name; add one here to make it selectable."""


def _shapes(param: str) -> str:
    return (
        f"{param}: must be a string, a list of strings, a list of token IDs (integers in "
        f"0..{MAX_TOKEN_ID}) or a list of lists of token IDs"
    )


def _token_ids(param: str, where: str, ids: list[object]) -> int:
    """The number of token IDs in ``ids`` (``where`` names the list in messages), each an
    integer in ``0..MAX_TOKEN_ID`` (not a boolean)."""
    for index, item in enumerate(ids):
        if type(item) is not int or not 0 <= item <= MAX_TOKEN_ID:
            raise EstimateError(
                param,
                f"{where}[{index}]: a token ID must be an integer in 0..{MAX_TOKEN_ID} "
                f"(got {_shown(item)})",
            )
    return len(ids)


def _batch(param: str, items: list[object]) -> None:
    if len(items) > MAX_BATCH_INPUTS:
        raise EstimateError(
            param,
            f"{param}: at most {MAX_BATCH_INPUTS} {'inputs' if param == 'input' else 'prompts'} "
            f"in a batch (got {len(items)})",
        )


def _same_shape(param: str, items: list[object], kind: type, what: str) -> None:
    """A batch of at most :data:`MAX_BATCH_INPUTS`, every element of ``kind`` as ``items[0]``
    is; else an :class:`EstimateError` naming the first element that is not."""
    _batch(param, items)
    for index, item in enumerate(items):
        if not isinstance(item, kind):
            raise EstimateError(
                param, f"{param}[{index}]: must be {what}, as {param}[0] is "
                f"(got {type(item).__name__}); {_shapes(param)}",
            )  # fmt: skip


def _inputs(value: object, param: str = "prompt") -> tuple[int, int, int]:
    """``(characters, token IDs, prompts)`` of a legacy completions ``prompt`` (or an embeddings
    ``input``: ``param``): a string (one prompt), a list of strings (one prompt each), a list of
    token IDs (one prompt of that many tokens) or a list of lists of token IDs (one prompt
    each). None (or ``[]``) is one empty prompt. The shape is read from the first element; an
    element of another shape is named in the message."""
    if value is None:
        return 0, 0, 1
    if isinstance(value, str):
        return len(value), 0, 1
    if not isinstance(value, list):
        raise EstimateError(param, f"{_shapes(param)} (got {type(value).__name__})")
    if not value:
        return 0, 0, 1
    first = value[0]
    if isinstance(first, str):
        _same_shape(param, value, str, "a string")
        return sum(map(len, value)), 0, len(value)
    if isinstance(first, list):
        _same_shape(param, value, list, "a list of token IDs")
        tokens = sum(
            _token_ids(param, f"{param}[{index}]", item) for index, item in enumerate(value)
        )
        return 0, tokens, len(value)
    return 0, _token_ids(param, param, value), 1


def prompts(body: Mapping[str, object]) -> int:
    """Prompts the request holds: one for a chat (``messages``), else as many as a legacy
    completions ``prompt`` batches (a list of strings, or a list of lists of token IDs); each
    generates its own ``max(n, best_of)`` sequences."""
    if body.get("messages") is not None:
        return 1
    return _inputs(body.get("prompt"))[2]


def _choices_param(body: Mapping[str, object], param: str) -> int | None:
    value = body.get(param)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise EstimateError(
            param, f"{param}: must be an integer in 1..{MAX_CHOICES} (got {_shown(value)})"
        )
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def sequences(body: Mapping[str, object]) -> int:
    """Sequences the request generates: ``max(n, best_of)`` (each default 1)."""
    if body.get("n") is None and body.get("best_of") is None:  # the common request
        return 1
    n = _choices_param(body, "n") or 1
    best_of = _choices_param(body, "best_of")
    if best_of is None:
        return n
    if best_of < n:
        raise EstimateError("best_of", f"best_of: must be >= n (got best_of={best_of}, n={n})")
    return best_of


def ends_at_its_bound(body: Mapping[str, object], chat: bool) -> bool:
    """Whether a request (that passed the estimate) generates one sequence of one prompt,
    bounded by its own limit as the engine reads it: it then decodes one token per engine step
    and ends by that bound (the KV view's peak forecast takes only such streams:
    ``kvDecodeBooking: peak``). ``chat``: a chat completion, bounded by ``max_tokens`` or
    ``max_completion_tokens``; else a legacy completion, which an engine bounds by
    ``max_tokens`` only (vLLM ignores ``max_completion_tokens`` there) and whose prompts are
    its ``prompt``'s (a ``messages`` beside it is ignored). Not so for ``n`` or ``best_of``
    above 1, a batch of prompts (several tokens a step), or no bound given (the engine may
    decode past the sidecar's ``defaultDecodeTokens``)."""
    bounds = (body.get("max_tokens"), body.get("max_completion_tokens")) if chat else (
        body.get("max_tokens"),
    )  # fmt: skip
    if not any(isinstance(v, int) and not isinstance(v, bool) for v in bounds):
        return False
    if sequences(body) != 1:
        return False
    return True if chat else _inputs(body.get("prompt"))[2] == 1


def decode_tokens(body: Mapping[str, object], default: int, cap: int) -> int:
    """Decode tokens of one sequence: the larger of ``max_completion_tokens`` and
    ``max_tokens`` where both are set, each checked (see the module docstring)."""
    larger = 0
    for param in ("max_completion_tokens", "max_tokens"):
        value = body.get(param)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(param, f"{param}: must be an integer >= 1 (got {_shown(value)})")
        if value > cap:
            raise EstimateError(param, f"{param}: must be <= {cap} (got {value})")
        larger = max(larger, value)
    return larger or default


def estimate(
    body: Mapping[str, object], estimator: PromptEstimator, default_decode: int, max_decode: int
) -> Estimate:
    """``prefill = estimator(body)``;
    ``decode = decode_tokens(body) * sequences(body) * prompts(body)``."""
    per_sequence = decode_tokens(body, default_decode, max_decode)
    return Estimate(estimator(body), per_sequence * sequences(body) * prompts(body))


def estimate_embeddings(body: Mapping[str, object], estimator: PromptEstimator) -> Estimate:
    """The cost of an embeddings request: ``prefill`` = every input's tokens (text by
    ``estimator``, token IDs one each) plus one per input (the sequence's start token: no
    input is free, however short), ``decode`` = 0 (see the module docstring). An empty input
    (``""``, ``[]``, or an empty element) is a 400 naming it, as OpenAI's API refuses it."""
    value = body.get("input")
    if value is None:
        raise EstimateError("input", f"input: required; {_shapes('input')}")
    _refuse_empty_input(value)
    chars, token_ids, inputs = _inputs(value, "input")
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        type(dimensions) is not int or not 1 <= dimensions <= MAX_EMBEDDING_DIMENSIONS
    ):
        raise EstimateError(
            "dimensions",
            f"dimensions: must be an integer in 1..{MAX_EMBEDDING_DIMENSIONS} "
            f"(got {_shown(dimensions)})",
        )
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in EMBEDDING_ENCODINGS:
        raise EstimateError(
            "encoding_format",
            f"encoding_format: must be one of {', '.join(EMBEDDING_ENCODINGS)} "
            f"(got {_shown(encoding)})",
        )
    # Text goes through the configured estimator as a prompt would; IDs are exact.
    text_tokens = estimator({"prompt": value}) if chars else 0
    return Estimate((text_tokens if chars else token_ids) + inputs, 0)


def _refuse_empty_input(value: object) -> None:
    """An embeddings ``input`` that is empty, or holds an empty string or list: a 400 naming
    the element (an empty input would otherwise cost nothing)."""
    if value == "" or value == []:
        raise EstimateError("input", "input: must not be empty")
    if isinstance(value, list):
        for index, item in enumerate(value):
            if item == "" or item == []:
                raise EstimateError("input", f"input[{index}]: must not be empty")
