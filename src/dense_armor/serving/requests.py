"""The requests of `dense-armor serve`'s standard-input mode: JSON lines or lines of text."""

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["read_requests"]


def read_requests(
    lines: Sequence[str], tokenizer: Any, default_new: int, where: str
) -> list[dict[str, Any]]:
    """`dense-armor serve`'s requests from the lines of its input (blank lines skipped): a line
    of text (encoded with `tokenizer`), or a JSON object `{"prompt": TEXT}` or `{"ids": [...]}`
    with `"max_new_tokens"` (default `default_new`) and `"id"` if wanted; `{"ids", "max_new",
    "id"}` each. A malformed line is a `ValueError` naming `where` and the line."""
    requests: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        text = line.rstrip("\n")
        entry: dict[str, Any] = {"prompt": text}
        if text.lstrip().startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} line {number}: not a JSON object ({error}).") from None
            if not isinstance(entry, dict) or ("prompt" in entry) == ("ids" in entry):
                raise ValueError(
                    f'{where} line {number}: a JSON request holds "prompt" (text) or "ids" '
                    "(token ids), one of them."
                )
        if "ids" in entry:
            ids = entry["ids"]
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise ValueError(f'{where} line {number}: "ids" must be a list of integers.')
        elif tokenizer is None:
            raise ValueError(
                f"{where} line {number}: a text prompt needs a tokenizer: pass --tokenizer "
                '(or give token ids, {"ids": [...]}).'
            )
        else:
            ids = tokenizer.encode(str(entry["prompt"])).ids
        new = entry.get("max_new_tokens", default_new)
        if not isinstance(new, int) or isinstance(new, bool) or new < 1:
            raise ValueError(f'{where} line {number}: "max_new_tokens" must be an integer >= 1.')
        requests.append({"ids": ids, "max_new": new, "id": entry.get("id", len(requests))})
    if not requests:
        raise ValueError(f"{where} holds no request: nothing to serve.")
    return requests
