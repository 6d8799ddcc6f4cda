"""OpenAI's `logprobs` objects from the engine's scores: the completions API's (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and the chat API's (`content`: each token's
`token`, `logprob`, `bytes` and `top_logprobs`).

A token's text is its own bytes as UTF-8; a token that holds part of a character (a byte-level
BPE splits them) is written `bytes:\\xNN...`, as OpenAI writes it, and its `bytes` are the
token's own (the chat API's way to join such pieces). A byte-level tokenizer's token is mapped
back to its bytes through GPT-2's byte alphabet; a byte-fallback token (`<0xNN>`) is its byte;
any other token is what the tokenizer decodes it to.
"""

import functools
import math
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["ScoreLog", "TokenText", "chat_logprobs", "completion_logprobs"]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in character, reversed."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    codes = printable + [256 + i for i in range(len(extra))]
    return {chr(code): byte for byte, code in zip(printable + extra, codes, strict=True)}


class TokenText:
    """A tokenizer's tokens as bytes and as the text OpenAI's logprobs show (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, bytes] = {}

    def raw(self, token: int) -> bytes:
        if token not in self._cache:
            self._cache[token] = self._bytes(int(token))
        return self._cache[token]

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if self.byte_level:
            alphabet = _byte_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        if match := _BYTE_FALLBACK.match(piece):
            return bytes([int(match.group(1), 16)])
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

    def text(self, token: int) -> str:
        raw = self.raw(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _number(value: float | None) -> float | None:
    """A log-probability as JSON holds it (-inf, which JSON has not, as -9999.0 as vLLM does)."""
    if value is None or math.isnan(value):
        return None
    return max(float(value), -9999.0)


def completion_logprobs(
    texts: TokenText,
    tokens: Sequence[int],
    logprobs: Sequence[float | None],
    tops: Sequence[Sequence[tuple[int, float]] | None],
    offset: int = 0,
) -> dict[str, Any]:
    """The completions API's `logprobs` of `tokens` (a score None: the echoed prompt's first
    token, which has none; its `top_logprobs` entry None too); `offset`: the first token's
    place in the choice's text."""
    strings = [texts.text(t) for t in tokens]
    offsets, at = [], offset
    for s in strings:
        offsets.append(at)
        at += len(s)
    top_dicts = [
        None if top is None else {texts.text(t): _number(v) for t, v in top} for top in tops
    ]
    return {
        "tokens": strings,
        "token_logprobs": [_number(v) for v in logprobs],
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def chat_logprobs(
    texts: TokenText,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[int, float]]],
) -> dict[str, Any]:
    """The chat API's `logprobs`: `{"content": [...]}`, one entry per token."""

    def entry(token: int, value: float) -> dict[str, Any]:
        return {"token": texts.text(token), "logprob": _number(value),
                "bytes": list(texts.raw(token))}  # fmt: skip

    content = [
        {**entry(t, v), "top_logprobs": [entry(a, w) for a, w in top]}
        for t, v, top in zip(tokens, logprobs, tops, strict=True)
    ]
    return {"content": content}


class ScoreLog:
    """One choice's scores as its tokens arrive, as OpenAI's `logprobs` objects: `k`
    alternatives each; a completion's `echo` puts its prompt's first (`prompt`, once its
    scores arrive with the first token)."""

    def __init__(self, texts: TokenText, chat: bool, k: int, echo: bool, prompt: list[int]):
        self.texts, self.chat, self.k, self.echo, self.prompt = texts, chat, k, echo, prompt
        self.parts: list[dict[str, Any]] = []  # each token's object (the prompt's first)
        self.offset = 0  # a completion's text offset of the next token

    def add(self, event: Any) -> dict[str, Any]:
        """The object of the tokens `event` brings: its token's, after the prompt's with the
        first token of an echo."""
        parts = []
        if self.echo and event.prompt is not None:
            own, ids, values = event.prompt
            tops = [None] + [self._top(i, v) for i, v in zip(ids[1:], values[1:], strict=True)]
            scores = [None, *own[1:].tolist()]
            parts.append(self._completion(self.prompt, scores, tops))
        top = [(int(t), float(v)) for t, v in (event.top or [])[: self.k]]
        if self.chat:
            parts.append(chat_logprobs(self.texts, [event.token], [event.logprob], [top]))
        else:
            parts.append(self._completion([event.token], [event.logprob], [top]))
        self.parts += parts
        return _joined(parts, self.chat)

    def whole(self) -> dict[str, Any] | None:
        return _joined(self.parts, self.chat) if self.parts else None

    def _top(self, ids: Any, values: Any) -> list[tuple[int, float]]:
        return [(int(i), float(v)) for i, v in zip(ids[: self.k], values[: self.k], strict=True)]

    def _completion(self, tokens: Sequence[int], scores: Any, tops: Any) -> dict[str, Any]:
        part = completion_logprobs(self.texts, tokens, scores, tops, self.offset)
        self.offset += sum(len(s) for s in part["tokens"])
        return part


def _joined(parts: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """Several tokens' objects as one."""
    if chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [x for part in parts for x in part[key]] for key in keys}
