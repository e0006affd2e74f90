# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Tiny Qwen3 models and character-level tokenizers built locally, on a CPU and without the Hub: the models of the
library's tests, and of a user's tests of an RPG set-up (a tiny model trains in seconds and downloads nothing). The
research package's toy tasks build their models with them too."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM


DEFAULT_ALPHABET = string.digits + "+-*=?:. \nAnswer"
PAD, EOS = "<pad>", "</s>"
#: A minimal chat template (one user turn, then the assistant's reply), so conversational datasets work too.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'Q:' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'A:' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `alphabet` (deduplicated) plus `<pad>` and `</s>`, left padding.

    Characters outside the alphabet are not representable: `ValueError` names them.
    """
    chars = sorted(set(alphabet) | set("QA:"))
    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"[\s\S]"), behavior="isolated"
    )  # every character, newlines included
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left", truncation_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_qwen3(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    seed: int = 0,
    vocab_size: int | None = None,
) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 causal LM sized for CPU tests (about 0.1M parameters with the defaults). Its
    vocabulary is the tokenizer's, or `vocab_size` rows (>= the tokenizer's; e.g. Qwen3's 151,936, so that the output
    layer and the log-softmax weigh what they weigh in a real model, the ids past the tokenizer's never sampled)."""
    import torch

    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"`vocab_size` must be at least the tokenizer's {len(tokenizer)} tokens; got {vocab_size}.")
    config = Qwen3Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def save_tiny_model(path, tokenizer=None, dtype: str = "float32", **model_kwargs) -> str:
    """Build a tiny Qwen3 and its tokenizer and save both to `path` (a local model id for `from_pretrained`), the
    weights in `dtype` (a torch dtype's name)."""
    import torch

    tokenizer = tokenizer or build_char_tokenizer()
    model = build_tiny_qwen3(tokenizer, **model_kwargs).to(getattr(torch, dtype))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
