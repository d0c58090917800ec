"""The validation machinery of the config dataclasses: converters, checked fields, dict building.

A field made with :func:`checked` carries its check (a converter and its arguments), the DeepSpeed
key it is read from, and (for a nested section) its class; :func:`validate` runs every check
on construction, :func:`build_from_dict` builds a config from nested dicts. Standard library only.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping

from zinf_jax.errors import ConfigError

__all__ = ["Invalid", "as_int", "as_bytes", "as_float", "as_other", "as_names", "one_of", "checked", "nested_field", "validate",
           "build_from_dict", "as_patterns", "NONNEG", "POSITIVE", "UNIT", "BOOL", "PATH", "OPTIMIZERS"]

OPTIMIZERS = ("adam", "adamw")
"""Optimizer names a config (or a DeepSpeed ``optimizer.type``) may give."""


class Invalid(Exception):
    """Raised by a converter; its text names the accepted values."""


def as_int(value: Any, minimum: int | None = None) -> int:
    """Returns ``value`` as an int; floats with an integral value (``1e9``) are accepted."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise Invalid("an integer" + ("" if minimum is None else f" >= {minimum}"))
    return value


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
               "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def as_bytes(value: Any, minimum: int = 1) -> int:
    """Returns a byte count: an int (or an integral float), or a str with an optional unit, decimal or binary
    (``"8GiB"``, ``"512 MiB"``, ``"16GB"``, ``"4e9"``)."""
    accepted = f"a byte count >= {minimum}: an int, or a str such as '8GiB', '512 MiB', '16GB'"
    if isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if m is None or m.group(2) not in _BYTE_UNITS:
            raise Invalid(accepted)
        value = float(m.group(1)) * _BYTE_UNITS[m.group(2)]
        value = int(value) if math.isfinite(value) else value
    try:
        return as_int(value, minimum)
    except Invalid:
        raise Invalid(accepted) from None


def as_float(value: Any, test: Callable[[float], bool], accepted: str) -> float:
    """Returns ``value`` (an int or float, not a bool) as a finite float if ``test`` accepts it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not test(value):
        raise Invalid(accepted)
    return float(value)


def as_other(value: Any, test: Callable[[Any], bool], accepted: str) -> Any:
    """Returns ``value`` (a path-like as a str) if ``test`` accepts it."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not test(value):
        raise Invalid(accepted)
    return value


# (test, accepted values) pairs for as_float and as_other.
NONNEG = (lambda v: v >= 0, "a number >= 0")
POSITIVE = (lambda v: v > 0, "a number > 0")
UNIT = (lambda v: 0 <= v < 1, "a number in [0, 1)")
BOOL = (lambda v: isinstance(v, bool), "true or false")
PATH = (lambda v: isinstance(v, str) and v != "", "a non-empty directory path (str or os.PathLike)")


def as_names(value: Any) -> tuple[str, ...]:
    """Returns a non-empty list or tuple of non-empty strs (mesh axis names) as a tuple."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise Invalid("a non-empty tuple of mesh axis names (non-empty str)")
    return tuple(value)


def as_patterns(value: Any) -> tuple[str, ...]:
    """Returns a list or tuple of regular expressions (str, each compiling) as a tuple; empty is fine."""
    import re

    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise Invalid("a tuple of regular expressions over parameter paths (non-empty str)")
    for v in value:
        try:
            re.compile(v)
        except re.error as e:
            raise Invalid(f"a tuple of valid regular expressions ({v!r}: {e})") from None
    return tuple(value)


def one_of(choices: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, str) and v in choices), "one of " + ", ".join(map(repr, choices))


def checked(default: Any, convert: Callable[..., Any], *args: Any, optional: bool = False,
           ds: str | tuple[str, ...] = (), nested: type | None = None) -> Any:
    """A field checked by ``convert(value, *args)``, read from DeepSpeed key ``ds`` (or its aliases)."""
    return dataclasses.field(default=default, metadata={"check": (convert, args, optional), "ds": ds, "nested": nested})


def nested_field(default: Any, cls: type, optional: bool = False) -> Any:
    """A field holding a ``cls`` instance (given as a dict of its fields to :meth:`ZeroConfig.from_dict`)."""
    return checked(default, as_other, lambda v: isinstance(v, cls), f"a zinf_jax.{cls.__name__}", optional=optional,
                  nested=cls)


def validate(obj: Any) -> None:
    """Checks every field of the frozen ``obj``, stores normalized values, else raises ConfigError."""
    for f in dataclasses.fields(obj):
        convert, args, optional = f.metadata["check"]
        value = getattr(obj, f.name)
        if optional and value is None:
            continue
        try:
            object.__setattr__(obj, f.name, convert(value, *args))
        except Invalid as e:
            detail = f"expected {e}{' or None' if optional else ''}, got {value!r}"
            raise ConfigError(f"{type(obj).__name__}.{f.name}: {detail}", field=f.name, detail=detail) from None


def build_from_dict(cls: type, d: Any, prefix: str) -> Any:
    """Builds ``cls`` from dict ``d``, recursing into its nested config fields."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: expected a dict, got {d!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [str(k) for k in d if k not in names]
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
                          f"accepted keys{' of ' + prefix.rstrip('.') if prefix else ''}: {', '.join(names)}")
    nested = {f.name: f.metadata["nested"] for f in dataclasses.fields(cls) if f.metadata["nested"]}
    kwargs = {k: build_from_dict(nested[k], v, f"{prefix}{k}.") if k in nested and v is not None else v
              for k, v in d.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if not prefix or e.field is None or e.field.startswith(prefix):
            raise
        key = prefix + e.field  # name the key as the file spells it: offload_param.device
        raise ConfigError(f"{key}: {e.detail}", field=key, detail=e.detail) from None
