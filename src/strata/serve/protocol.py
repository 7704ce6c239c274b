"""Request bodies of the OpenAI API subset Strata serves, and its error body."""

from __future__ import annotations

from typing import Union

from pydantic import BaseModel, ConfigDict, Field


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    logprobs: Union[bool, int, None] = None
    stream: bool = False
    user: str | None = None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage]
    top_logprobs: int | None = None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
