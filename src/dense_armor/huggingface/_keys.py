"""The rule every importer keeps: a config key is read or refused, never dropped.

A family's `arguments` reads its config through `Config`, which records each key it looks at
(`get`, `[...]`, `in`). `read_arguments` then refuses every key of the file that the family did
not read, unless it is one of `INERT` (keys that never change what the model computes in
inference: token ids, dtypes, dropout rates, training-only settings, the library's bookkeeping),
one of the family's own `IGNORED` (keys the architecture's transformers model does not read), or
at its neutral value (`NEUTRAL`). So a key that a later config format adds, or that a family's
reading forgets, stops the import by name instead of leaving the model silently different from
transformers'. Reading a key makes the family answerable for it: the golden data of every
family (`tests/data/hf`) and its hub-form configs (`tests/data/hf_configs.json`: the hub's older
spellings, defaults left out, beside transformers' own reading of them) check that it is read
right.
"""

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ._files import HuggingFaceError

__all__ = ["INERT", "NEUTRAL", "Config", "read_arguments", "with_changes"]

INERT = frozenset(
    {
        # the library's bookkeeping and the file's own description
        "_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
        "torch_dtype", "use_bfloat16", "_attn_implementation_autoset", "_commit_hash",
        "auto_map", "tokenizer_class", "task_specific_params", "finetuning_task",
        "id2label", "label2id", "num_labels", "problem_type", "return_dict", "output_attentions",
        "output_hidden_states", "output_scores", "return_dict_in_generate", "torchscript",
        "chunk_size_feed_forward", "is_encoder_decoder", "cache_implementation", "use_cache",
        # token ids: which token starts or ends a text, not what the model computes
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
        "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
        # generation defaults kept in older configs (the request's rules decide)
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        "remove_invalid_values", "prefix", "tf_legacy_loss",
        # training only: initialisation, dropout (off in inference), the routers' auxiliary loss
        # and jitter (the loss is `next_token_loss_balanced`'s argument here)
        "initializer_range", "initializer_factor", "attention_dropout", "attn_pdrop",
        "embd_pdrop", "resid_pdrop", "residual_dropout", "embedding_dropout", "hidden_dropout",
        "summary_first_dropout", "output_router_logits", "router_aux_loss_coef",
        "router_jitter_noise",
        # Llama's tensor-parallel split of its products in pretraining: the same products
        "pretraining_tp",
        # GPT-2's sequence-summary head, which a causal language model does not have
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    }
)  # fmt: skip
# Keys harmless at these values, refused at any other
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "pruned_heads": ({},),
    "is_decoder": (False,),
    "add_cross_attention": (False,),
    "tie_encoder_decoder": (False,),
    "cross_attention_hidden_size": (None,),
    "quantization_config": (None,),
}


class Config(dict[str, Any]):
    """A config whose reads are recorded in `read` (shared with the copies `replace` makes)."""

    def __init__(self, data: Mapping[str, Any], read: set[str] | None = None):
        super().__init__(data)
        self.read: set[str] = set() if read is None else read

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)

    def replace(self, **changes: Any) -> "Config":
        """A copy with `changes`, whose reads count as this config's."""
        return Config({**self, **changes}, self.read)


def with_changes(config: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """`config` with `changes` (what a family derives from older keys), its reads still
    recorded when it is a `Config`."""
    if isinstance(config, Config):
        return config.replace(**changes)
    return {**config, **changes}


def unread_keys(
    config: Mapping[str, Any], read: set[str], ignored: tuple[str, ...] = ()
) -> list[str]:
    """The keys of `config` that change the mathematics and were not read."""
    return sorted(
        key
        for key, value in config.items()
        if key not in read
        and key not in INERT
        and key not in ignored
        and not (key in NEUTRAL and value in NEUTRAL[key])
    )


def read_arguments(
    family: ModuleType, config: Mapping[str, Any], architecture: str
) -> dict[str, Any]:
    """`family.arguments(config, architecture)` over the family's `DEFAULTS` (transformers' own
    for each key a config leaves out), refusing every key it did not read (see the module)."""
    defaults = getattr(family, "DEFAULTS", {}).get(architecture, {})
    tracked = Config({**defaults, **config})
    arguments: dict[str, Any] = family.arguments(tracked, architecture)
    ignored = tuple(getattr(family, "IGNORED", {}).get(architecture, ()))
    unread = unread_keys(config, tracked.read, ignored)
    if unread:
        shown = {key: config[key] for key in unread[:6]}
        raise HuggingFaceError(
            f"config.json: {architecture} keys the importer does not read: {shown}. Each may "
            "change what the model computes; refusing rather than ignoring them."
        )
    return arguments
