"""Chat prompts: a tokenizer's chat template rendered as transformers' `apply_chat_template`
renders it.

`ChatTemplate.from_directory(dir)` reads the template of a tokenizer directory (`chat_template`
in `tokenizer_config.json`, or a `chat_template.jinja` file beside it) and its special tokens;
`render(messages, add_generation_prompt=True)` gives the prompt's text. The template runs in
jinja2's immutable sandbox (a template from the Hub is untrusted code), with transformers'
environment: `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter
that does not escape HTML, `raise_exception`, `strftime_now`, `dict` and a `namespace` that
refuses underscore names, and a `{% generation %}` block rendered as its body. The special tokens
(`bos_token`, `eos_token`, ...) are the template's variables, as transformers passes them.
"""

import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatError", "ChatTemplate"]

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatError(ValueError):
    """A chat that cannot be rendered: no template, a malformed message, or the template's own
    `raise_exception`."""


def _classes() -> tuple[Any, Any]:
    """The template's `{% generation %}` extension (its body, as transformers renders it) and a
    `namespace` that refuses underscore names (jinja2 imported here: the serve extra)."""
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):  # `{% generation %}...{% endgeneration %}`: its body
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not store underscore names on a namespace: {name!r}."
                )

    return Generation, Namespace


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    generation, namespace = _classes()
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=raise_exception,
        namespace=namespace,
        dict=dict,
        strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
    )
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it sees (see the module)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        import jinja2

        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ChatError(f"the chat template does not compile: {error}") from None
        self.source, self.special_tokens = source, dict(special_tokens or {})

    @classmethod
    def from_directory(cls, directory: str | pathlib.Path) -> "ChatTemplate":
        """The template of a tokenizer directory (`tokenizer_config.json`'s `chat_template`, or
        `chat_template.jinja`), with the config's special tokens. `ChatError` if it has none."""
        directory = pathlib.Path(directory)
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = config.get("chat_template")
        if (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text()
        if isinstance(source, list):  # named templates: the default one
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        if not isinstance(source, str):
            raise ChatError(
                f"{directory} has no chat template (no chat_template.jinja, and no "
                "`chat_template` in tokenizer_config.json)."
            )
        return cls(source, _special_tokens(config))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text of `messages` (each a mapping with a `role` and `content`)."""
        import jinja2

        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ChatError(f"messages[{i}] must be an object with a string `role`.")
        chat = [dict(m) for m in messages]
        try:
            return str(
                self.template.render(
                    messages=chat,
                    tools=variables.pop("tools", None),
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **{**self.special_tokens, **variables},
                )
            )
        except jinja2.TemplateError as error:
            raise ChatError(f"the chat template refused the messages: {error}") from None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, Mapping):  # an AddedToken written out: {"content": ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
