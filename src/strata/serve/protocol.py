"""Request bodies of the OpenAI API subset Strata serves, and its error body.

Integers are strict (`"max_tokens": true` is an error, not 1); sampling fields left out are filled
from the server's defaults (`strata serve --temperature ...`), else OpenAI's."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator


def _number(v):
    if isinstance(v, bool):
        raise ValueError("must be a number, not a boolean")
    return v


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None)
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    logprobs: Union[StrictBool, StrictInt, None] = None
    stream: StrictBool = False
    user: StrictStr | None = None

    _numbers = field_validator("temperature", "top_p", mode="before")(_number)


class CompletionRequest(_Common):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    echo: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: Union[StrictStr, dict, None] = None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
