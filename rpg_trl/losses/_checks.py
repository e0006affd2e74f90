# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""Argument checks shared by the loss modules: an error names the argument, what was allowed and what was given."""

from __future__ import annotations

import math


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}.")


def _check_finite_number(name: str, value, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number; got {value!r}.")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"`{name}` must be {relation} {minimum}; got {value!r}.")
    return float(value)
