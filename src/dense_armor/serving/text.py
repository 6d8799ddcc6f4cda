"""Text out of a stream of token ids: incremental detokenization and stop strings.

`TextStream(tokenizer, stop)` takes a request's new tokens one at a time and gives the text that
is final so far:

- Only whole characters: a token that ends inside a multi-byte UTF-8 character (a byte-level
  BPE splits them) decodes to U+FFFD until the character's last byte arrives; such text is held
  back, so no U+FFFD from a split character is ever sent.
- Stop strings are matched on the decoded text, across token boundaries: text that could be the
  start of a stop string is held back until it cannot; when one appears, the text before it is
  the last sent, and the stream is `stopped` (the stop string itself is never sent).

The text is decoded from all the request's tokens each time, so a tokenizer whose decoding of a
token depends on its neighbours (a leading space, a byte fallback) gives what `decode(tokens)`
gives: the concatenation of the pieces sent equals the decoded text, cut at the stop string.
"""

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental text of one request (see the module). `push(token)` returns the new final
    text (possibly ""); `finish()` the held-back rest once the request ended (no stop string
    in it); `stopped` is True once a stop string appeared, `text` is everything sent."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""  # sent so far
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that became final with `token` ("" if none did, or the stream stopped)."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        decoded = self.tokenizer.decode(self.tokens)
        if decoded.endswith(_REPLACEMENT):  # a character still incomplete
            decoded = decoded.rstrip(_REPLACEMENT)
        return self._release(decoded, final=False)

    def finish(self) -> str:
        """The rest of the text once the request ended (cut at a stop string if one appears)."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.tokens), final=True)

    def _release(self, decoded: str, final: bool) -> str:
        if not decoded.startswith(self.text):  # a decoding that revised earlier text: hold
            return ""
        cut = _first_stop(decoded, self.stop, len(self.text))
        if cut is not None:
            self.stopped = True
            return self._send(decoded[:cut])
        safe = len(decoded) if final else len(decoded) - _held(decoded, self.stop)
        return self._send(decoded[: max(safe, len(self.text))])

    def _send(self, upto: str) -> str:
        new, self.text = upto[len(self.text) :], upto
        return new


def _first_stop(text: str, stops: Sequence[str], sent: int) -> int | None:
    """Where the earliest stop string in `text` begins, at or after `sent` (text that could
    begin one is never sent)."""
    found = [i for s in stops if (i := text.find(s, sent)) != -1]
    return min(found) if found else None


def _held(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could begin a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
