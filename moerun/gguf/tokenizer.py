"""The tokenizer a GGUF file describes in its `tokenizer.*` metadata.

Two vocabulary kinds are read, under llama.cpp's key names:

* ``gpt2``: byte-level BPE. Text is cut by the regexes that ``tokenizer.ggml.pre`` names, each
  piece is spelled in GPT-2's byte alphabet and merged by ``tokenizer.ggml.merges``.
* ``llama``: SentencePiece BPE. Spaces become ``▁`` (one more in front of each run of text when
  ``add_space_prefix``), pieces merge best score first, and characters outside the vocabulary fall
  back to ``<0xNN>`` byte tokens.

In both, tokens typed control, unknown or user-defined are matched whole in the text first, as
llama.cpp does with ``parse_special``. Encoding runs in a Rust ``tokenizers.Tokenizer``; decoding
maps each id to its bytes here, so that streamed text joins up to exactly the decoded text.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from moerun.errors import MoerunError

# Values of tokenizer.ggml.token_type.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MATCHED_WHOLE = (UNKNOWN, CONTROL, USER_DEFINED)

SPM_SPACE = "\u2581"

# Pre-tokenizer regexes as the models' tokenizer.json files write them; llama.cpp cuts text alike.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
FALCON_SPLITS = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_SPLIT, r"[0-9][0-9][0-9]")
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-tokenizes one family of ``tokenizer.ggml.pre`` names.

    The ``splits`` run one after another, each cutting every piece the one before left, and the
    text between matches stays a piece too. ``ignore_merges`` takes a piece found whole in the
    vocabulary as it is; ``add_bos`` is the default when the file has no ``add_bos_token``.
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


def _family(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_family("default", PreTokenizer(DEFAULT_SPLITS)),
    **_family(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    ),
    **_family("dbrx smaug-bpe glm4 chatglm-bpe", PreTokenizer((LLAMA3_SPLIT,))),
    **_family(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo"
        " jais trillion granite-docling exaone4 jina-v1-en jina-v2-code roberta-bpe",
        PreTokenizer((GPT2_SPLIT,)),
    ),
    **_family(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        PreTokenizer((QWEN2_SPLIT,)),
    ),
    **_family("qwen35", PreTokenizer((QWEN35_SPLIT,))),
    **_family("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((GPT4O_SPLIT,))),
    **_family("tekken", PreTokenizer((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)),
    **_family(
        "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
        PreTokenizer((r"\p{N}", GPT2_SPLIT)),
    ),
    **_family("falcon", PreTokenizer(FALCON_SPLITS)),
    **_family("deepseek-v3 hunyuan-dense joyai-llm hy_v4", PreTokenizer(DEEPSEEK3_SPLITS)),
}

# Tokens that end generation by their text alone, whatever ids the file names (as in llama.cpp).
END_OF_GENERATION_TEXTS = frozenset(
    "<|eot_id|> <|eom_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <EOT>"
    " <｜end▁of▁sentence｜>".split()
)


class TokenizerError(MoerunError):
    """The GGUF tokenizer metadata is missing, malformed or of a kind moerun does not read."""


class TooManyTokens(MoerunError):
    """Text that encodes to more tokens than the caller allows (``encode(..., max_tokens=N)``)."""

    def __init__(self, count: int, limit: int):
        super().__init__(f"the text has {count} tokens, more than the {limit} allowed")
        self.count = count
        self.limit = limit


class StreamDecoder:
    """Text of ids that arrive one at a time, as soon as it is complete.

    ``push`` returns what the new id completes; an unfinished UTF-8 sequence (an emoji arriving
    byte token by byte token) is held back until its last byte comes. ``flush`` returns what is
    left, with U+FFFD for bytes that never formed a character.
    """

    def __init__(self, piece: Callable[[int], bytes], strip_leading_space: bool):
        self._piece = piece
        self._strip_leading_space = strip_leading_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        data = self._piece(token_id)
        if self._strip_leading_space and data:
            self._strip_leading_space = False
            data = data.removeprefix(b" ")
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """Encode and decode text with the vocabulary of a GGUF file; build it with ``from_metadata``."""

    def __init__(
        self,
        backend: RustTokenizer,
        tokens: list[str],
        token_types: list[int],
        *,
        spm: bool,
        add_space_prefix: bool,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: frozenset[int],
        add_bos: bool,
        chat_template: str | None,
    ):
        self._backend = backend
        self._tokens = tokens
        self._types = token_types
        self._spm = spm
        self._add_space_prefix = add_space_prefix
        self._byte_alphabet = None if spm else byte_alphabet_decoder()
        self._pieces: dict[int, bytes] = {}
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos
        self.chat_template = chat_template

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (the ``tokenizer.*`` keys, as llama.cpp reads them)."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("the GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} "
                "(moerun reads 'gpt2' BPE and 'llama' SentencePiece vocabularies)"
            )
        tokens = _token_list(meta)
        types = _per_token(meta, "tokenizer.ggml.token_type", len(tokens), default=NORMAL)
        spm = model == "llama"
        if spm:
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            scores = _per_token(meta, "tokenizer.ggml.scores", len(tokens))
            backend = _build(_spm_backend, tokens, types, scores, add_space_prefix)
            add_bos_default, bos_default, eos_default = True, 1, 2
        else:
            add_space_prefix = False
            pre = _pre_tokenizer(meta)
            backend = _build(_gpt2_backend, tokens, types, _merges(meta), pre)
            add_bos_default, bos_default, eos_default = pre.add_bos, None, None

        bos_id = _special_id(meta, "bos", len(tokens), bos_default)
        eos_id = _special_id(meta, "eos", len(tokens), eos_default)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        if add_bos and bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        ends = {eos_id, _special_id(meta, "eot", len(tokens)), _special_id(meta, "eom", len(tokens))}
        ends.update(i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS)
        ends.discard(None)
        return cls(
            backend,
            tokens,
            types,
            spm=spm,
            add_space_prefix=add_space_prefix,
            bos_id=bos_id,
            eos_id=eos_id,
            stop_ids=frozenset(ends),
            add_bos=add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def encode(self, text: str, add_bos: bool | None = None, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in it become their ids.

        ``add_bos=None`` follows the file (``self.add_bos``). BOS is never doubled: text that already
        starts with the BOS token (a chat template writing ``bos_token``) gets no second one.
        With ``max_tokens``, more tokens than that raise TooManyTokens before any list of ids is made.
        The Rust tokenizer runs without holding the GIL, so other threads go on meanwhile.
        """
        encoding = self._backend.encode_batch_fast([text], add_special_tokens=False)[0]
        bos = self._bos_to_add(text, self.add_bos if add_bos is None else add_bos)
        count = len(bos) + len(encoding)
        if max_tokens is not None and count > max_tokens:
            raise TooManyTokens(count, max_tokens)
        return bos + encoding.ids

    def _bos_to_add(self, text: str, add_bos: bool) -> list[int]:
        if not add_bos:
            return []
        if self.bos_id is None:
            raise TokenizerError("this vocabulary has no BOS token to add")
        return [] if text.startswith(self._tokens[self.bos_id]) else [self.bos_id]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; ``skip_special`` leaves out control and unknown tokens."""
        stream = self.stream_decoder(skip_special)
        return "".join([stream.push(token_id) for token_id in ids]) + stream.flush()

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """A decoder for ids that arrive one at a time; what it returns joins up to ``decode``'s text."""
        return StreamDecoder(partial(self._piece, skip_special=skip_special), self._add_space_prefix)

    def token_text(self, id: int) -> str:
        """The token as the vocabulary spells it (``Ġ`` for a byte-level space, ``▁`` in SentencePiece)."""
        if not 0 <= id < self.vocab_size:
            raise IndexError(f"token id {id} is outside the vocabulary ({self.vocab_size} tokens)")
        return self._tokens[id]

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        text = self.token_text(token_id)
        kind = self._types[token_id]
        if kind in (CONTROL, UNKNOWN):
            return b"" if skip_special else text.encode()
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._bytes_of(text, kind)
        return piece

    def _bytes_of(self, text: str, kind: int) -> bytes:
        if kind == USER_DEFINED:
            return text.encode()
        if kind == BYTE:
            return bytes([int(text[3:5], 16)])
        if self._spm:
            return text.replace(SPM_SPACE, " ").encode()
        alphabet = self._byte_alphabet
        return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in text)


def byte_level_pre_tokenizer(splits: Sequence[str]) -> pre_tokenizers.PreTokenizer:
    """Cut text by each regex in turn, then spell every piece in GPT-2's byte alphabet."""
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def byte_alphabet_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet read backwards: the character standing for each byte -> the byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    decoder, stand_in = {}, 256
    for byte in range(256):
        if byte in printable:
            decoder[chr(byte)] = byte
        else:
            decoder[chr(stand_in)] = byte
            stand_in += 1
    return decoder


def _token_list(meta: Mapping[str, Any]) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens) == 0:
        raise TokenizerError("the GGUF metadata has no token list (tokenizer.ggml.tokens)")
    # llama.cpp renames empty tokens the same way, so that each has a text to match.
    tokens = [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
    first_id: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if first_id.setdefault(text, i) != i:
            raise TokenizerError(f"duplicate token {text!r} in tokenizer.ggml.tokens (ids {first_id[text]} and {i})")
    return tokens


def _per_token(meta: Mapping[str, Any], key: str, n_tokens: int, default: Any = None) -> list:
    values = meta.get(key)
    if values is None:
        if default is None:
            raise TokenizerError(f"the GGUF metadata has no {key}, which this vocabulary needs")
        return [default] * n_tokens
    if len(values) != n_tokens:
        raise TokenizerError(f"{key} has {len(values)} entries, but tokenizer.ggml.tokens has {n_tokens}")
    return np.asarray(values).tolist()


def _special_id(meta: Mapping[str, Any], name: str, n_tokens: int, default: int | None = None) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    token_id = meta.get(key, default)
    if token_id is None:
        return None
    if not 0 <= int(token_id) < n_tokens:
        raise TokenizerError(f"{key} = {token_id} is outside the vocabulary ({n_tokens} tokens)")
    return int(token_id)


def _pre_tokenizer(meta: Mapping[str, Any]) -> PreTokenizer:
    name = meta.get("tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre); moerun knows {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerError("the GGUF metadata has no tokenizer.ggml.merges, which a 'gpt2' vocabulary needs")
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges (expected 'left right')")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _build(make: Callable[..., RustTokenizer], *args: Any) -> RustTokenizer:
    try:
        return make(*args)
    except Exception as error:  # the Rust side reports bad vocabularies as plain Exceptions
        raise TokenizerError(f"cannot build the tokenizer from the GGUF metadata: {error}") from error


def _gpt2_backend(
    tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: PreTokenizer
) -> RustTokenizer:
    vocab = {text: i for i, text in enumerate(tokens)}
    backend = _matching_whole_tokens(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges), tokens, types)
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre.splits)
    return backend


def _spm_backend(tokens: list[str], types: list[int], scores: list[float], add_space_prefix: bool) -> RustTokenizer:
    vocab = {text: i for i, text in enumerate(tokens)}
    unknown = next((text for text, kind in zip(tokens, types) if kind == UNKNOWN), None)
    model = models.BPE(vocab, _spm_merges(tokens, types, scores), unk_token=unknown, fuse_unk=True, byte_fallback=True)
    backend = _matching_whole_tokens(model, tokens, types)
    escape_spaces = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape_spaces]) if add_space_prefix else escape_spaces
    )
    return backend


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece: every way to spell a normal token as two normal tokens,
    ranked by that token's score, best first (SentencePiece joins the best-scoring pair first)."""
    normal = {text: i for i, (text, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    ranked = []
    for text, i in normal.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _matching_whole_tokens(model: models.Model, tokens: list[str], types: list[int]) -> RustTokenizer:
    """A Rust tokenizer over ``model`` that first matches control, unknown and user-defined tokens whole."""
    backend = RustTokenizer(model)
    whole = [(text, kind) for text, kind in zip(tokens, types) if kind in MATCHED_WHOLE]
    specials = [AddedToken(text, special=True, normalized=False) for text, kind in whole if kind != USER_DEFINED]
    user_defined = [AddedToken(text, special=False, normalized=False) for text, kind in whole if kind == USER_DEFINED]
    backend.add_special_tokens(specials)
    backend.add_tokens(user_defined)
    return backend
