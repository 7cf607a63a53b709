"""Request bytes -> a JSON object later code may trust: valid Unicode, finite numbers, bounded
nesting. Refusals are `APIError`s in the OpenAI shape. Pure: no I/O, no aiohttp (the router
parses with it too).
"""

from __future__ import annotations

import json
import math
from typing import Any

from disagg.server.openai_api import APIError

__all__ = ["MAX_JSON_DEPTH", "parse_json_body"]

MAX_JSON_DEPTH = 64  # nesting levels a body may have (the top object is level 1)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Request bytes -> JSON object whose every string is valid Unicode, every number is finite
    and whose nesting is at most MAX_JSON_DEPTH, so later code may encode, compare and recurse
    freely. NaN/Infinity are refused, and so is an overflow like 1e309 (json makes it inf)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise _too_deep() from exc
    except ValueError as exc:  # includes UnicodeDecodeError
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    _check_json_value(body, 1)
    return body


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _check_json_value(value: Any, depth: int) -> None:
    """One walk over a parsed body: depth, string encodability (keys too), finite numbers."""
    if isinstance(value, str):
        _check_json_str(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise APIError(400, f"numbers must be finite, got {value}", code="invalid_value")
    elif isinstance(value, dict):
        _check_json_depth(depth)
        for key, item in value.items():
            _check_json_str(key)
            _check_json_value(item, depth + 1)
    elif isinstance(value, list):
        _check_json_depth(depth)
        for item in value:
            if type(item) is not int:  # the bulk of a token-id prompt: nothing to check
                _check_json_value(item, depth + 1)


def _check_json_str(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        message = "JSON body has a string that is not valid Unicode (a lone surrogate escape)"
        raise APIError(400, message, code="invalid_value") from exc


def _check_json_depth(depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise _too_deep()


def _too_deep() -> APIError:
    return APIError(
        400, f"JSON body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
    )
