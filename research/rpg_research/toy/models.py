# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""The toy tasks' models: tiny Qwen3 models and character-level tokenizers built locally (no hub), by the library's
testing package ([`rpg_trl.testing.models`], whose names are importable from here too), in the sizes of each task
([`build_sized_model`])."""

from __future__ import annotations

from rpg_trl.testing.models import (
    CHAT_TEMPLATE,
    DEFAULT_ALPHABET,
    EOS,
    PAD,
    build_char_tokenizer,
    build_tiny_qwen3,
    save_tiny_model,
)


__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_ALPHABET",
    "EOS",
    "PAD",
    "build_char_tokenizer",
    "build_sized_model",
    "build_tiny_qwen3",
    "save_tiny_model",
]


def build_sized_model(seed: int, sizes: dict[str, dict], size: str, alphabet: str = DEFAULT_ALPHABET):
    """A task's character tokenizer over `alphabet` and its randomly initialised Qwen3 of `size`, one of `sizes` (size
    name -> [`build_tiny_qwen3`]'s architecture arguments)."""
    if size not in sizes:
        raise ValueError(f"`size` must be one of {sorted(sizes)}; got {size!r}.")
    tokenizer = build_char_tokenizer(alphabet)
    return build_tiny_qwen3(tokenizer, seed=seed, **sizes[size]), tokenizer
