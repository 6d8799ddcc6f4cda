"""Structured output: a grammar that constrains a request's tokens, read by the `Server` through
one protocol (`Constraint`), and `Grammars`, which makes them from JSON schemas with llguidance
(the `structured` extra: a wheel with no dependency of its own, which reads the checkpoint's
`tokenizer.json` itself).

The `Server` asks a request's constraint for the mask of its next token (`fill`: int32 words,
bit `t % 32` of word `t // 32` for each token `t` it allows) before each token is drawn; the mask
goes to the device into the slot's row of the sampler's history (`nn.penalties.History`), where
every token it does not allow gets a logit of `-inf` after the penalties. Each token drawn is
given back (`advance`); the request ends when the grammar is complete (`finished`: nothing but
its end may follow). While a constrained request decodes, every dispatch runs one step (the mask
of the second step depends on the first's token, which only the host's grammar can read).
"""

import collections
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..nn.penalties import mask_words

__all__ = ["COMPILED_KEPT", "Constraint", "GrammarError", "Grammars"]

COMPILED_KEPT = 256  # grammars a `Grammars` keeps compiled, the latest used


class Constraint(Protocol):
    """What constrains a request's tokens: `fill(words)` writes the mask of the next token into
    `words` (int32, `nn.penalties.mask_words(vocab)` of them), `advance(token)` takes the token
    drawn, `finished` says that nothing but the end may follow."""

    def fill(self, words: np.ndarray) -> None: ...

    def advance(self, token: int) -> None: ...

    @property
    def finished(self) -> bool: ...


class GrammarError(ValueError):
    """A grammar that cannot be compiled; `field`: the API field that gave it."""

    def __init__(self, message: str, field: str = "response_format") -> None:
        super().__init__(message)
        self.field = field


class _Matcher:
    """A `Constraint` over one of llguidance's matchers."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self._matcher, self._words = matcher, mask_words(vocab)

    def fill(self, words: np.ndarray) -> None:
        if words.dtype != np.int32 or words.shape != (self._words,) or not words.flags.c_contiguous:
            raise ValueError(f"a mask is {self._words} contiguous int32 words")
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def advance(self, token: int) -> None:
        self._matcher.consume_token(int(token))

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped() or self._matcher.is_error())


class Grammars:
    """Constraints for a model's requests from JSON schemas: `tokenizer` (the checkpoint's: a
    `tokenizers.Tokenizer`, or the path of its `tokenizer.json`), `vocab` (the model's: ids past
    the tokenizer's are never allowed) and `stop_tokens` (the tokens that may end a complete
    output). Each schema is compiled once (`compiled`, kept by its text); a request gets its own
    matcher."""

    def __init__(self, tokenizer: Any, vocab: int, stop_tokens: Sequence[int] = ()) -> None:
        try:
            import llguidance
        except ImportError:
            raise ImportError(
                "structured output needs llguidance: pip install 'dense_armor[structured]'"
            ) from None
        self._llg, self.vocab = llguidance, int(vocab)
        eos = [int(t) for t in stop_tokens] or None
        # a `tokenizers.Tokenizer` (its JSON), or the path of a tokenizer.json
        given = tokenizer.to_str() if hasattr(tokenizer, "to_str") else os.fspath(tokenizer)
        self._tokenizer = llguidance.LLTokenizer(given, n_vocab=self.vocab, eos_token=eos)
        # the latest COMPILED_KEPT grammars, by their text: a client sending ever new schemas
        # costs a compilation each, never memory without bound
        self.compiled: collections.OrderedDict[str, str] = collections.OrderedDict()

    def lark(self, grammar: str, field: str = "response_format") -> Constraint:
        """Text of a Lark grammar (llguidance's dialect: `%json {schema}` inline), `field` the
        API field its refusal names."""
        return self._matcher(grammar, "grammar", field, self._llg.LLMatcher.grammar_from_lark)

    def json_object(self) -> Constraint:
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: Mapping[str, Any], strict: bool = True) -> Constraint:
        """A JSON value valid for `schema` (OpenAI's `{"type": "json_schema", "json_schema":
        {"schema": ...}}`), compact (no whitespace between tokens of JSON); `strict=False`:
        keywords the engine does not implement are ignored instead of refused."""
        if not isinstance(schema, Mapping):
            raise GrammarError("`json_schema.schema` must be a JSON object.")
        options: Any = {"whitespace_flexible": False, "lenient": not strict}

        def compile_schema(_: str) -> str:
            return self._llg.LLMatcher.grammar_from_json_schema(dict(schema), options)

        key = json.dumps([schema, strict], sort_keys=True)
        return self._matcher(key, "JSON schema", "response_format", compile_schema)

    def _matcher(self, key: str, what: str, field: str, compile_text: Any) -> Constraint:
        """A request's matcher of the grammar `key` names, compiled (by `compile_text(key)`) and
        checked against the tokenizer the first time, kept among the latest compiled."""
        grammar = self.compiled.pop(key, None)
        if grammar is None:
            try:
                grammar = compile_text(key)
            except ValueError as error:
                raise GrammarError(f"the {what} cannot be compiled: {error}", field) from None
            failed, messages = self._llg.LLMatcher.validate_grammar_with_warnings(
                grammar, self._tokenizer
            )
            if failed:
                raise GrammarError(f"the {what} cannot be compiled: {messages[0]}", field)
        self.compiled[key] = grammar  # the most recent last
        while len(self.compiled) > COMPILED_KEPT:
            self.compiled.popitem(last=False)
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {what} cannot be compiled: {matcher.get_error()}", field)
        return _Matcher(matcher, self.vocab)
