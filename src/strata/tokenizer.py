"""Text <-> token ids: a model folder's tokenizer.json (with its chat template when present), or the
vocabulary a GGUF file carries, rebuilt with the tokenizers library."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import StrataError


class Tokenizer:
    def __init__(self, tok, chat_template: str | None = None, special: dict[str, str] | None = None):
        """tok: a tokenizers.Tokenizer; special: the text of bos_token / eos_token, for chat templates."""
        self._tok, self.chat_template, self.special = tok, chat_template, dict(special or {})

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer | None":
        folder = Path(folder)
        return cls._read_folder(folder) if (folder / "tokenizer.json").is_file() else None

    @classmethod
    def from_gguf(cls, kv: dict, where) -> "Tokenizer | None":
        """The vocabulary of a GGUF file's tokenizer.ggml.* keys, or None when it carries none."""
        from .gguf_vocab import Vocab

        vocab = Vocab.from_metadata(kv, where)
        if vocab is None:
            return None
        special = {f"{k}_token": vocab.tokens[vocab.special[k]] for k in ("bos", "eos")
                   if 0 <= vocab.special.get(k, -1) < len(vocab.tokens)}
        return cls(vocab.to_tokenizers(where), vocab.chat_template, special)

    @classmethod
    def _read_folder(cls, folder: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise StrataError(f"{path}: cannot load tokenizer ({e})") from None
        chat_template, special = None, {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise StrataError(f"{cfg_path}: not valid JSON ({e})") from None
            chat_template = cfg.get("chat_template")
            for key in ("bos_token", "eos_token"):
                value = cfg.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    special[key] = value
        template_file = folder / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        return cls(tok, chat_template, special)

    def encode(self, text: str) -> list[int]:
        """The ids of text. Through encode_batch, which releases the GIL while it works (a single encode
        held it for seconds on a long prompt, stalling every other thread, the server's event loop too)."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise StrataError("this model's tokenizer has no chat template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except jinja2.exceptions.TemplateError as e:
            raise StrataError(f"chat template: {e}") from None


class StreamDecoder:
    """Turns a growing list of ids into text increments without splitting multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta
