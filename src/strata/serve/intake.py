"""A request's way in: its body read under a size cap and a deadline, its JSON into the protocol's model,
its text into token ids, refused as soon as it is known not to fit the context."""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import Request
from pydantic import ValidationError

from ..errors import StrataError
from ..tokenizer import Tokenizer
from .guard import APIError

#: characters of a prompt past which its tokenizing's freed memory is handed back to the system
LONG_TEXT = 1 << 20


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused past `limit` bytes (413) or when it does not arrive within `timeout` (408)."""
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s") from None
    return b"".join(chunks)


def decode_request(raw: bytes, model):
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"field '{where}': {err['msg']}", param=where) from None


def too_long(chars: int, limit: int, max_len: int, param: str) -> APIError:
    return APIError(400, f"prompt of {chars} characters does not fit the context of {max_len} tokens (it encodes "
                         f"to more than the {limit} tokens a prompt may have beside max_tokens)", param=param)


def encode(tokenizer: Tokenizer | None, text: str, param: str, limit: int, max_len: int) -> list[int]:
    """A prompt's ids, refused as soon as it is known to pass `limit` tokens (Tokenizer.encode_within)."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param=param)
    check_unicode(text, param)
    try:
        ids = tokenizer.encode_prompt(text, limit)
    finally:
        give_back_memory(len(text))
    if ids is None:
        raise too_long(len(text), limit, max_len, param)
    return ids


def encode_chat(tokenizer: Tokenizer, messages: list[dict], limit: int, max_len: int) -> list[int]:
    for i, m in enumerate(messages):
        check_unicode(m["content"], f"messages[{i}].content")
    chars = sum(len(m["content"]) for m in messages)
    try:
        ids = tokenizer.encode_chat(messages, limit=limit)
    except StrataError as e:
        raise APIError(400, str(e), param="messages") from None
    finally:
        give_back_memory(chars)
    if ids is None:
        raise too_long(chars, limit, max_len, "messages")
    return ids


def give_back_memory(chars: int) -> None:
    """After a long text's tokenizing: the heap's free memory returned to the system (glibc keeps what a
    large request freed, and a server would hold its peak for good)."""
    if chars < LONG_TEXT:
        return
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} is not valid Unicode ({e.reason} at character {e.start})", param=param) from None
