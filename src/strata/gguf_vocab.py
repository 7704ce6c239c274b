"""A model's vocabulary as llama.cpp's GGUF files carry it (tokenizer.ggml.* and tokenizer.chat_template):
built from a Hugging Face tokenizer.json with `tokenizers` and gguf's SpecialVocab, read from a GGUF's
metadata, written with a GGUFWriter, and compared.

llama.cpp loads a vocabulary for every model it opens, drafters included, and names the
pre-tokenizer of a byte-level BPE vocabulary by the regexes its tokenizer splits with (PRE_TOKENIZERS:
llama.cpp's spelling of them, and the tokenizer.json pattern each is named for); which tokens it adds
around a prompt and which end generation are its rules too."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import StrataError

# Token types (llama.cpp's enum, also gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LINES = r"\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class Pre:
    """A byte-level BPE pre-tokenizer llama.cpp names: the regexes it splits the text with, in turn (its own
    spelling, which tokenizers' Oniguruma runs alike), whether a word that is a token skips the merges,
    whether a BOS is added when tokenizer.ggml.add_bos_token is absent, and the regex of the models'
    tokenizer.json Split step it is named for."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    adds_bos: bool = False
    hf_split: str | None = None


def _contracted(body: str, **flags) -> Pre:
    """A pre-tokenizer whose regex starts with the English contractions: tokenizer.json writes them
    case-insensitive, llama.cpp with a class per letter."""
    return Pre((r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])" + body,),
               hf_split=r"(?i:'s|'t|'re|'ve|'m|'ll|'d)" + body, **flags)


#: the pre-tokenizers Strata rebuilds, by llama.cpp's name
PRE_TOKENIZERS = {
    "gpt-2": Pre((_GPT2_SPLIT,)),
    "qwen2": _contracted(r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _LINES),
    "qwen35": _contracted(r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|" + _LINES),
    "llama-bpe": _contracted(r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _LINES,
                             ignore_merges=True, adds_bos=True),
    "smollm": Pre((r"\p{N}", _GPT2_SPLIT)),
    "tekken": Pre((r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
                   r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _LINES,),
                  ignore_merges=True, adds_bos=True,
                  hf_split=r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?"
                           r"[^\s\p{L}\p{N}]+[\r\n/]*|" + _LINES),
}
#: llama.cpp's other names for the same pre-tokenizers
PRE_ALIASES = {"phi-2": "gpt-2", "deepseek-r1-qwen": "qwen2", "kormo": "qwen2", "megrez": "qwen2",
               **{n: "llama-bpe" for n in ("llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")}}
#: a tokenizer.json's Split regex followed by a ByteLevel step without its own regex -> llama.cpp's name
SPLIT_PRE = {pre.hf_split: name for name, pre in PRE_TOKENIZERS.items() if pre.hf_split}
SPECIAL_KEYS = ("bos", "eos", "unk", "sep", "pad", "mask", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
#: llama.cpp's special ids where a vocabulary of that kind names none (dropped when past its end)
DEFAULT_SPECIAL = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}
#: token texts llama.cpp takes as ending generation
END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
#: texts llama.cpp takes as the FIM pad / repository / file-separator tokens when no key names them; they end
#: generation too
FIM_END_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                 "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                 "fim_sep": ("<|file_sep|>",)}
SPACE = "\u2581"  # SentencePiece's space
#: the vocabulary's flags: add_special's keys, and the SentencePiece space prefix
FLAG_KEYS = {"bos": "tokenizer.ggml.add_bos_token", "eos": "tokenizer.ggml.add_eos_token",
             "sep": "tokenizer.ggml.add_sep_token", "space_prefix": "tokenizer.ggml.add_space_prefix"}


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # bos/eos/... -> token id
    add_special: dict[str, bool] = field(default_factory=dict)  # add_bos_token, ... -> flag
    chat_template: str | None = None
    scores: list[float] | None = None
    add_space_prefix: bool | None = None  # SentencePiece: a space before the text (llama.cpp's default: yes)

    @classmethod
    def from_metadata(cls, kv: dict, where="") -> "Vocab | None":
        """The vocabulary a GGUF file carries, or None when it has none; a malformed one is refused naming
        its key."""
        if "tokenizer.ggml.model" not in kv:
            return None

        def bad(key: str, what: str):
            return StrataError(f"{where}: metadata key '{key}' {what}")

        def listed(key: str, ok, what: str, count: int | None = None) -> list | None:
            v = kv.get(key)
            if v is None:
                return None
            if not isinstance(v, list) or not all(ok(x) for x in v):
                raise bad(key, f"must be a list of {what}")
            if count is not None and len(v) != count:
                raise bad(key, f"holds {len(v)} entries for {count} tokens")
            return v

        model = kv["tokenizer.ggml.model"]
        if not isinstance(model, str):
            raise bad("tokenizer.ggml.model", f"must be a string, got {model!r}")
        tokens = listed("tokenizer.ggml.tokens", lambda x: isinstance(x, str), "strings")
        if not tokens:
            raise bad("tokenizer.ggml.tokens", "is missing or empty (expected the tokens, by id)")
        n = len(tokens)
        number = (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool))
        special = {}
        for k in SPECIAL_KEYS:
            key = f"tokenizer.ggml.{k}_token_id"
            if key in kv:
                tid = kv[key]
                if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < n:
                    raise bad(key, f"must be a token id below {n}, got {tid!r}")
                special[k] = tid
        flags = {}
        for k, key in FLAG_KEYS.items():
            if key in kv:
                if not isinstance(kv[key], bool):
                    raise bad(key, f"must be true or false, got {kv[key]!r}")
                flags[k] = kv[key]
        template = kv.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise bad("tokenizer.chat_template", f"must be a string, got {type(template).__name__}")
        pre = kv.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise bad("tokenizer.ggml.pre", f"must be a string, got {pre!r}")
        return cls(model=model, pre=pre, tokens=tokens,
                   token_types=listed("tokenizer.ggml.token_type", lambda x: type(x) is int, "integers", n)
                   or [NORMAL] * n,
                   merges=listed("tokenizer.ggml.merges", lambda x: isinstance(x, str) and " " in x,
                                 "strings 'left right'") or [],
                   special=special, add_special={k: v for k, v in flags.items() if k != "space_prefix"},
                   chat_template=template, scores=listed("tokenizer.ggml.scores", number, "numbers", n),
                   add_space_prefix=flags.get("space_prefix"))

    def write(self, writer) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges:
            writer.add_token_merges(self.merges)
        for key, tid in self.special.items():
            if key in SPECIAL_KEYS and key != "mask":  # a drafter's mask id is written with its contract
                writer.add_uint32(f"tokenizer.ggml.{key}_token_id", tid)
        for key, flag in self.add_special.items():
            getattr(writer, f"add_add_{key}_token")(flag)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template:
            writer.add_chat_template(self.chat_template)

    def special_id(self, kind: str) -> int | None:
        """A special token's id as llama.cpp resolves it: its key, else the default of the vocabulary's kind."""
        if kind in self.special:
            return self.special[kind]
        tid = DEFAULT_SPECIAL.get(self.model, {}).get(kind)
        return tid if tid is not None and tid < len(self.tokens) else None

    def adds(self, kind: str) -> bool:
        """Whether llama.cpp puts this special token ("bos", "eos") around every prompt it encodes."""
        if kind in self.add_special:
            return self.add_special[kind]
        return kind == "bos" and (self.model == "llama" or (self.byte_pre is not None and self.byte_pre.adds_bos))

    @property
    def byte_pre(self) -> Pre | None:
        """A byte-level BPE vocabulary's pre-tokenizer (None: another kind, or one Strata lacks)."""
        return PRE_TOKENIZERS.get(PRE_ALIASES.get(self.pre, self.pre)) if self.model == "gpt2" else None

    def end_of_generation(self) -> set[int]:
        """The ids llama.cpp stops generating at: EOS, EOT and EOM, the FIM pad / repository / file-separator
        tokens, and every token whose text is one of END_TEXTS; <|end|> not where <|return|> and <|call|>
        (or <|calls|> and <|flush|>) exist, </s> not beside <|tool_response> or <|plamo:eos|>."""
        by_text = {t: i for i, t in enumerate(self.tokens)}  # a repeated text: its last id, as llama.cpp
        ends = {by_text[t] for t in END_TEXTS if t in by_text}
        for kind, texts in FIM_END_TEXTS.items():
            found = [by_text[t] for t in texts if t in by_text]
            tid = self.special.get(kind, found[0] if found else None)
            if tid is not None:
                ends.add(tid)
        ends |= {tid for tid in map(self.special_id, ("eos", "eot", "eom")) if tid is not None}
        texts = {self.tokens[i] for i in ends}
        if "<|end|>" in texts and (texts >= {"<|return|>", "<|call|>"} or texts >= {"<|calls|>", "<|flush|>"}):
            ends.discard(by_text["<|end|>"])
        if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
            ends.discard(by_text["</s>"])
        return ends

    def to_tokenizers(self, where):
        """The tokenizers-library tokenizer that encodes as llama.cpp does with this vocabulary, added tokens
        kept whole: byte-level BPE with the merges and the pre-tokenizer llama.cpp names (gpt2), or
        SentencePiece BPE (llama): spaces as U+2581, one before the text, the adjacent pair whose piece
        scores highest merged first (spm_merges), characters outside the vocabulary as byte tokens."""
        from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab = {}
        for i, t in enumerate(self.tokens):
            vocab.setdefault(t, i)
        try:
            if self.model == "llama":
                unk = self.tokens[self.special["unk"]] if "unk" in self.special else None
                tok = HFTokenizer(models.BPE(vocab, spm_merges(vocab, self.scores, where), unk_token=unk,
                                             fuse_unk=True, byte_fallback=True))
                prefix = self.add_space_prefix is not False
                tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE)] * prefix +
                                                      [normalizers.Replace(" ", SPACE)])
                tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                                 decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * prefix)
                special = (CONTROL, UNKNOWN)
            elif self.model == "gpt2":
                pre = self.byte_pre
                if pre is None:
                    raise UnsupportedVocab(f"{where}: tokenizer.ggml.pre {self.pre!r} is not supported (supported: "
                                           f"{', '.join([*PRE_TOKENIZERS, *PRE_ALIASES])})")
                if not self.merges:  # as llama.cpp, which refuses the file
                    raise StrataError(f"{where}: metadata key 'tokenizer.ggml.merges' is missing (a byte-level BPE "
                                      f"vocabulary needs its merges)")
                merges = [tuple(m.split(" ", 1)) for m in self.merges]
                tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
                tok.pre_tokenizer = pre_tokenizers.Sequence(
                    [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
                    + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
                tok.decoder = decoders.ByteLevel()
                special = (CONTROL,)
            else:
                raise UnsupportedVocab(f"{where}: tokenizer.ggml.model {self.model!r} is not supported (supported: "
                                       f"gpt2, byte-level BPE; llama, SentencePiece BPE)")
            kinds = list(zip(self.tokens, self.token_types))
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k in special])
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == USER_DEFINED])
            tok.post_processor = self._added_around(where)
        except StrataError:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise StrataError(f"{where}: cannot build a tokenizer from its vocabulary ({e})") from None
        return tok

    def added(self, where) -> dict[str, int]:
        """The BOS / EOS llama.cpp puts around every prompt: kind -> id; one it adds but lacks is refused."""
        out = {}
        for kind in ("bos", "eos"):
            if self.adds(kind):
                tid = self.special_id(kind)
                if tid is None:
                    how = f"metadata key '{FLAG_KEYS[kind]}'" if kind in self.add_special else "its kind, by default,"
                    raise StrataError(f"{where}: {how} adds a {kind.upper()} token to every prompt, but no "
                                      f"'tokenizer.ggml.{kind}_token_id' names one")
                out[kind] = tid
        return out

    def _added_around(self, where):
        """The BOS / EOS llama.cpp adds around a prompt, as a tokenizers post-processor."""
        from tokenizers import processors

        added = self.added(where)
        if not added:
            return None
        single = ["BOS:0"] * ("bos" in added) + ["$A:0"] + ["EOS:0"] * ("eos" in added)
        return processors.TemplateProcessing(single=" ".join(single), special_tokens=[
            {"id": kind.upper(), "ids": [tid], "tokens": [self.tokens[tid]]} for kind, tid in added.items()])

    def difference(self, other: "Vocab") -> str | None:
        """Where two vocabularies differ (tokens and their types, merges), or None."""
        if len(self.tokens) != len(other.tokens):
            return f"{len(self.tokens)} tokens vs {len(other.tokens)}"
        for i, (a, b) in enumerate(zip(self.tokens, other.tokens)):
            if a != b:
                return f"token {i} is {a!r} vs {b!r}"
        if self.merges != other.merges:
            return f"merges differ ({len(self.merges)} vs {len(other.merges)})"
        return None


class UnsupportedVocab(StrataError):
    """A vocabulary of a kind Strata cannot rebuild (the model still runs on token ids)."""


def spm_merges(ids: dict[str, int], scores: list[float] | None, where) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary's merge order as BPE merges: every split of a token (ids: token -> its
    first id) into two tokens, ranked by the merged token's score, highest first, as llama.cpp merges the
    adjacent pair whose concatenation is the best-scoring token."""
    if scores is None:
        raise StrataError(f"{where}: metadata key 'tokenizer.ggml.scores' is missing (a SentencePiece vocabulary "
                          f"ranks its merges by them)")
    ranked = []
    for t, i in ids.items():
        for cut in range(1, len(t)):
            if t[:cut] in ids and t[cut:] in ids:
                ranked.append((-scores[i], i, cut, t))
    ranked.sort()
    return [(t[:cut], t[cut:]) for _, _, cut, t in ranked]


def pre_tokenizer_name(spec: dict, where) -> str:
    """llama.cpp's name for a byte-level BPE tokenizer.json's pre-tokenizer."""
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is None:
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
            return "gpt-2"
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
        if steps and len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel" \
                and not steps[1].get("use_regex", True):
            name = SPLIT_PRE.get((steps[0].get("pattern") or {}).get("Regex"))
            if name:
                return name
    raise StrataError(f"{where}: cannot tell llama.cpp's pre-tokenizer name for this tokenizer; give it with "
                      f"--tokenizer-pre NAME (llama.cpp's list: gpt-2, qwen2, llama-bpe, ...)")


def from_tokenizer_folder(folder: Path, vocab_size: int | None = None, pre: str | None = None) -> Vocab:
    """A tokenizer.json (with its tokenizer_config.json) as llama.cpp's converter writes it: tokens by id (ids
    the tokenizer lacks below vocab_size padded as [PADi], unused), added special tokens as control tokens,
    the special token ids and the chat template; a byte-level BPE's merges (gpt2), or a byte-fallback BPE's
    (Llama 2 and Mistral's SentencePiece models converted) as a llama vocabulary: scores that merge in the
    same order (_merge_scores), <0xNN> byte tokens, and whether a space goes before the text."""
    import gguf
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        tok = Tokenizer.from_file(str(path))
    except (OSError, ValueError, Exception) as e:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise StrataError(f"{path}: cannot load tokenizer ({e})") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise StrataError(f"{path}: only BPE vocabularies can be written (byte-level, or SentencePiece-style with "
                          f"byte fallback); got a {model.get('type')} model")
    spm = bool(model.get("byte_fallback"))
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab_size or 0, max(vocab.values()) + 1)
    by_id = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    unk = model.get("unk_token")
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        text = by_id[i]
        if spm and text == unk:
            types.append(UNKNOWN)
        elif i in added:
            if not added[i].normalized and not spm:
                text = tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
            types.append(CONTROL if added[i].special or _looks_special(text) else USER_DEFINED)
        else:
            types.append(BYTE if spm and _is_byte_token(text) else NORMAL)
        tokens.append(text)
    special = gguf.SpecialVocab(folder, load_merges=not spm)
    common = dict(tokens=tokens, token_types=types, special=dict(special.special_token_ids),
                  add_special={k: bool(v) for k, v in special.add_special_token.items() if k in ("bos", "eos", "sep")},
                  chat_template=special.chat_template if isinstance(special.chat_template, str) else None)
    if spm:
        return Vocab(model="llama", pre=None, scores=_merge_scores(tokens, model.get("merges") or []),
                     add_space_prefix=_space_prefix(spec, path), **common)
    return Vocab(model="gpt2", pre=pre or pre_tokenizer_name(spec, path), merges=list(special.merges), **common)


def _is_byte_token(text: str) -> bool:
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">") and \
        all(c in "0123456789ABCDEFabcdef" for c in text[3:5])


def _merge_scores(tokens: list[str], merges: list) -> list[float]:
    """SentencePiece scores for a byte-fallback BPE's tokens, by which llama.cpp merges the adjacent pair whose
    concatenation scores highest: a token's is minus the rank of the first merge that makes it (a tokenizer.json
    converted from a SentencePiece model lists its merges by the pieces' scores), so the two merge in the same
    order; a token no merge makes scores below them all (a single character never merges into it)."""
    first: dict[str, int] = {}
    for rank, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        first.setdefault(a + b, rank)
    return [-float(first[t]) if t in first else -float(len(merges) + i) for i, t in enumerate(tokens)]


def _space_prefix(spec: dict, path: Path) -> bool:
    """Whether a SentencePiece-style tokenizer.json puts U+2581 before the text (llama.cpp's
    add_space_prefix). Its spaces must become U+2581, as llama.cpp's do: through a Replace normalizer
    (Llama 2's converter) or a Metaspace pre-tokenizer (later ones); anything else is refused."""
    def steps(node) -> list[dict]:
        if not node:
            return []
        return [s for n in node.get("normalizers") or node.get("pretokenizers") or [node] for s in steps(n)] \
            if node.get("type") == "Sequence" else [node]

    norms, pres = steps(spec.get("normalizer")), steps(spec.get("pre_tokenizer"))
    if any(n.get("type") == "Replace" and (n.get("pattern") or {}).get("String") == " " and n.get("content") == SPACE
           for n in norms):
        return any(n.get("type") == "Prepend" and n.get("prepend") == SPACE for n in norms)
    meta = [p for p in pres if p.get("type") == "Metaspace" and p.get("replacement") == SPACE]
    if meta:
        return meta[0].get("prepend_scheme", "always" if meta[0].get("add_prefix_space", True) else "never") != "never"
    raise StrataError(f"{path}: a byte-fallback BPE whose spaces do not become U+2581 (no Replace normalizer or "
                      f"Metaspace pre-tokenizer) is not a SentencePiece-style vocabulary llama.cpp reads")


def _looks_special(text: str) -> bool:
    """Added tokens some tokenizers leave unmarked although they are control tokens."""
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<pad>", "<mask>")


def for_target(target: Path, vocab_size: int | None = None, pre: str | None = None) -> Vocab:
    """The vocabulary of a target: its folder's tokenizer.json, or the keys of its GGUF file."""
    target = Path(target)
    if target.is_dir():
        if not (target / "tokenizer.json").is_file():
            raise StrataError(f"{target}: no tokenizer.json to take the vocabulary from")
        return from_tokenizer_folder(target, vocab_size, pre)
    from . import gguf_file

    vocab = Vocab.from_metadata(gguf_file.read(target)[0], target)
    if vocab is None:
        raise StrataError(f"{target}: the GGUF file carries no vocabulary (tokenizer.ggml.model)")
    return vocab
