"""Make the chat tests' tokenizer directory and transformers' renderings of its chat template
(needs transformers and tokenizers; run once, output kept; transformers is not a dependency of
the package or the tests).

    python tests/torch_reference/make_chat_golden.py

`tests/data/chat/`: a byte-level tokenizer whose ids are the UTF-8 bytes (the trained byte model
of examples/language_model.py reads them: `tokenizer.json`), a `tokenizer_config.json` with a
chat template that uses what templates from the Hub use (a system prompt by default through a
`namespace`, `raise_exception` for a bad role, loop controls, `tojson`, `trim_blocks` and
`lstrip_blocks` whitespace; `bos_token` undefined, as in a tokenizer without one, renders
empty), and `golden.json`: each conversation below rendered by transformers'
`apply_chat_template` (with and without the generation prompt) and its token ids.
"""

import json
import pathlib

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

HERE = pathlib.Path(__file__).resolve().parent.parent / "data" / "chat"

TEMPLATE = """{%- set ns = namespace(system='You are a careful Python programmer.') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
{%- endif %}
{{ bos_token }}# system: {{ ns.system }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles are user and assistant, after an optional system') }}
    {% endif %}
# {{ message['role'] }}: {{ message['content'] | trim }}
    {% if message.get('meta') %}
# meta: {{ message['meta'] | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
# assistant:
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [
        {"role": "system", "content": "  Answer in Python. "},
        {"role": "user", "content": "Sort a list\nin place."},
        {"role": "assistant", "content": "xs.sort()"},
        {"role": "user", "content": "Now reversed: héllo → wörld"},
    ],
    [{"role": "user", "content": "import os", "meta": {"lang": "py", "n": 2, "é": "<&>"}}],
]


def _byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per UTF-8 byte, id = the byte's value."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    to_char = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(to_char.values())
    vocab = {to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def main() -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    tokenizer = _byte_tokenizer()
    sample = "héllo → wörld\n\tdef f(): pass"
    assert tokenizer.encode(sample).ids == list(sample.encode()), "ids must be the bytes"
    assert tokenizer.decode(list(sample.encode())) == sample
    tokenizer.save(str(HERE / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
        "model_max_length": 148,
    }  # fmt: skip
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    fast = transformers.AutoTokenizer.from_pretrained(HERE)
    golden = []
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            text = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            ids = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert list(ids) == list(text.encode()), "the template's ids are its bytes"
            golden.append({"messages": messages, "add_generation_prompt": prompt, "text": text})
    try:
        fast.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
        raise AssertionError("the template accepts a bad role")
    except Exception as error:  # transformers' TemplateError
        refused = str(error)
    (HERE / "golden.json").write_text(
        json.dumps({"renders": golden, "bad_role_error": refused}, indent=1, ensure_ascii=False)
        + "\n"
    )
    print(f"wrote {HERE}: {len(golden)} renders")


if __name__ == "__main__":
    main()
