"""Command-line flags that set fields of the config dataclasses (`disagg serve`, `disagg route`).

A flag's type, default and choices come from the field it sets, so the two cannot drift apart:
each command's table names only the field, the flag and its help. Must not read the environment
or validate values (config.py does both when the parsed values become a config).
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields
from typing import Any, Literal

__all__ = ["add_field_flag"]


def add_field_flag(
    parser: argparse.ArgumentParser,
    cls: type,
    name: str,
    flag: str,
    help_text: str,
    *,
    dest: str,
    metavar: str | None = None,
) -> None:
    """Add `flag`, which parses into args.<dest> the value of field `name` of the dataclass
    `cls`. A bool field's flag names the non-default behaviour and takes no value; a Literal
    field's takes one of its values; any other takes one of the field's type, shown as
    `metavar` (default: the flag's name upper-cased, `--kv-host` -> KV_HOST)."""
    kind = typing.get_type_hints(cls)[name]
    default = next(f.default for f in fields(cls) if f.name == name)
    assert default is not MISSING, f"{cls.__name__}.{name} needs a default to become a flag"
    if kind is bool:
        # --no-prefix-caching sets enable_prefix_caching (default True) False.
        action = "store_false" if default else "store_true"
        parser.add_argument(flag, dest=dest, action=action, help=help_text)
        return
    extra: dict[str, Any] = {
        "metavar": metavar or flag.removeprefix("--").replace("-", "_").upper()
    }
    if typing.get_origin(kind) is Literal:
        extra = {"choices": list(typing.get_args(kind))}  # argparse shows them as the metavar
        kind = type(extra["choices"][0])
    parser.add_argument(flag, dest=dest, type=kind, default=default, help=help_text, **extra)
