"""Text <-> token ids: a model folder's tokenizer.json (with its chat template when present), or the
vocabulary a GGUF file carries, rebuilt with the tokenizers library."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .errors import StrataError


#: encode_within's margin on its character bound (a normalizer may compose characters)
CHARS_PER_TOKEN_BOUND = 4
#: characters of a piece encode_within counts a long text in, and the tokens a cut may add to the count
PIECE_CHARS = 1 << 16
PIECE_SLACK = 16


def pieces(text: str, size: int):
    """text in consecutive pieces of about `size` characters, each cut after the last line break in its
    second half, else before the last whitespace there, else at `size`."""
    start = 0
    while start < len(text):
        end = start + size
        if end < len(text):
            half = start + size // 2
            cut = text.rfind("\n", half, end)
            if cut >= 0:
                end = cut + 1
            else:
                space = max(text.rfind(" ", half, end), text.rfind("\t", half, end))
                end = space if space > half else end
        yield text[start:end]
        start = end


class Tokenizer:
    def __init__(self, tok, chat_template: str | None = None, special: dict[str, str] | None = None,
                 chat_strips: tuple[str, str] | None = None, end_ids: set[int] | None = None):
        """tok: a tokenizers.Tokenizer whose post-processor adds the model's own BOS / EOS to a prompt (a
        folder: its tokenizer.json's, which transformers applies whatever tokenizer_config.json's
        add_bos_token says); special: the text of bos_token / eos_token, for chat templates; chat_strips:
        None to encode a rendered chat template without the added tokens (transformers'
        apply_chat_template), else the BOS / EOS text stripped from its ends before encoding it with them
        (llama.cpp); end_ids: the ids the vocabulary itself ends generation at."""
        self._tok, self.chat_template, self.special = tok, chat_template, dict(special or {})
        self.chat_strips, self.end_ids = chat_strips, set(end_ids or ())

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
        ids = {k: vocab.special_id(k) for k in ("bos", "eos")}
        special = {f"{k}_token": vocab.tokens[i] for k, i in ids.items() if i is not None}
        added = vocab.added(where)
        strips = tuple(vocab.tokens[added[k]] if k in added else "" for k in ("bos", "eos"))
        return cls(vocab.to_tokenizers(where), vocab.chat_template, special, strips, vocab.end_of_generation())

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
            if not isinstance(cfg, dict):
                raise StrataError(f"{cfg_path}: expected a JSON object")
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

    def encode(self, text: str, added: bool = False, limit: int | None = None) -> list[int] | None:
        """The ids of text; added: with the tokens the model puts around a prompt (BOS). Through
        encode_batch, which releases the GIL while it works (a single encode held it for seconds on a long
        prompt, stalling every other thread, the server's event loop too). limit: None instead of ids past
        this many tokens, found with work and memory bounded by the limit, not by the text (encode_within)."""
        if limit is not None:
            return self.encode_within(text, limit, added)
        return self._tok.encode_batch([text], add_special_tokens=added)[0].ids

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the vocabulary's longest token as the vocabulary spells it (a byte-level token one
        character per byte, a SentencePiece token one per character): a text of n characters takes at least
        n / longest_token tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def beyond(self, chars: int, limit: int) -> bool:
        """Whether a text of `chars` characters surely encodes to more than `limit` tokens (past
        CHARS_PER_TOKEN_BOUND x limit x longest_token characters), told without tokenizing it."""
        return chars > CHARS_PER_TOKEN_BOUND * limit * self.longest_token

    def encode_within(self, text: str, limit: int, added: bool = False, piece: int = PIECE_CHARS) -> list[int] | None:
        """encode(text, added), or None when that is more than `limit` tokens. A text of more than
        CHARS_PER_TOKEN_BOUND x limit x longest_token characters is refused untokenized; a long one is
        first counted in pieces of `piece` characters cut at whitespace, and refused as soon as the count passes
        the limit by more than PIECE_SLACK tokens a cut (a cut changes a count by a token or two), so an
        oversized text costs about `limit` tokens of work whatever its length."""
        if self.beyond(len(text), limit):
            return None
        if len(text) > piece:
            count = 0
            for n, part in enumerate(pieces(text, piece), 1):
                count += len(self.encode(part))
                if count > limit + PIECE_SLACK * n:
                    return None
        ids = self.encode(text, added)
        return ids if len(ids) <= limit else None

    def encode_prompt(self, text: str, limit: int | None = None) -> list[int] | None:
        """A user's prompt, as the model's own tools encode it: with the BOS / EOS its tokenizer adds."""
        return self.encode(text, added=True, limit=limit)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    limit: int | None = None) -> list[int] | None:
        """A conversation through the chat template, encoded as transformers (a folder) or llama.cpp (a GGUF
        vocabulary) does: both give one BOS where the template writes it and the model adds it."""
        if limit is not None and self.beyond(sum(len(m["content"]) for m in messages), limit):
            return None
        text = self.apply_chat_template(messages, add_generation_prompt)
        if self.chat_strips is None:
            return self.encode(text, limit=limit)
        head, tail = self.chat_strips
        if head and text.startswith(head):
            text = text[len(head):]
        if tail and text.endswith(tail):
            text = text[:-len(tail)]
        return self.encode_prompt(text, limit)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise StrataError("this model's tokenizer has no chat template")
        import jinja2

        try:
            return compiled_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except jinja2.exceptions.TemplateError as e:
            raise StrataError(f"chat template: {e}") from None


@functools.lru_cache(maxsize=8)
def compiled_template(source: str):
    """A chat template compiled in the sandbox with what transformers' apply_chat_template gives templates:
    loop controls, a {% generation %} block (rendered as its body), raise_exception, strftime_now, and a
    tojson that keeps non-ASCII and HTML characters as they are."""
    import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
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

    def finish(self) -> str:
        """What push held back at the end: a character the last ids left incomplete (as U+FFFD, as decode
        gives it), so that the streamed text equals the decoded whole."""
        text = self.tok.decode(self.ids)
        delta, self.emitted = text[len(self.emitted):], text
        return delta
