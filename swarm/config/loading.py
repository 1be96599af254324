"""Build nested config dataclasses from YAML files and command-line flags.

Every leaf field of a role's config becomes one flag named after the field (``--num_layers``),
with the field's ``help`` metadata as its help; a YAML file mirrors the nesting of the
dataclasses. Flags override the file; the dataclasses validate themselves in ``__post_init__``.
Unknown keys are refused with the dotted name of the offending field.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import yaml

__all__ = ["ConfigError", "RoleArgs", "config_from_dict", "parse_role_args", "parse_role_config"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field."""


def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


_COMMENTED_FIELD = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")


def _field_help(cls: type) -> Dict[str, str]:
    """Field help from ``metadata['help']`` or else the comment after the field (units live there)."""
    try:
        comments = {m[1]: m[2] for m in map(_COMMENTED_FIELD.match, inspect.getsource(cls).splitlines()) if m}
    except (OSError, TypeError):
        comments = {}
    return {f.name: f.metadata.get("help", comments.get(f.name, "")) for f in dataclasses.fields(cls)}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, name: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (arg for arg in args if arg is not type(None)):
            try:
                return _coerce(value, option, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: invalid value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{name}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple, Sequence):
        if isinstance(value, str):
            value = [item for item in value.split(",") if item]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        items = [_coerce(item, args[0] if args else Any, name) for item in value]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if tp in (int, float):
        try:
            if isinstance(value, bool) or (tp is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    return value


def config_from_dict(cls: Type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build ``cls`` from a nested mapping; unknown keys and bad values raise :class:`ConfigError`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {type(data).__name__}")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass: configs are built only into dataclasses")
    hints, fields = _hints(cls), {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config field {prefix + unknown[0]!r}; known fields: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if _is_dataclass_type(tp):
            kwargs[name] = config_from_dict(tp, value or {}, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix or cls.__name__ + ': '}{e}") from None


def _leaves(cls: type, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], dataclasses.Field, Any]]:
    hints, helps = _hints(cls), _field_help(cls)
    for field in dataclasses.fields(cls):
        if _is_dataclass_type(hints[field.name]):
            yield from _leaves(hints[field.name], path + (field.name,))
        else:
            yield path + (field.name,), field, helps[field.name]


def _is_text(cls: type, path: Sequence[str]) -> bool:
    """Whether the leaf at ``path`` holds text (``str`` or ``Optional[str]``): its flag's value is taken as
    written, so that ``--prompt 1984`` or ``--prompt yes`` stay text instead of becoming a number or a bool."""
    tp: Any = cls
    for name in path:
        tp = _hints(tp)[name]
    args = (
        [arg for arg in typing.get_args(tp) if arg is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
    )
    return args == [str]


def _flag_value(cls: type, path: Sequence[str], value: Any) -> Any:
    """A flag's value: a list as given, text as written (``null`` still clears an optional text), anything else
    read as a YAML scalar (``true``, ``2e-3``, ``null``)."""
    if isinstance(value, list):
        return value
    if _is_text(cls, path) and value not in ("null", "~"):
        return value
    return yaml.safe_load(value)


def _add_arguments(parser: argparse.ArgumentParser, cls: type) -> Dict[str, Tuple[str, ...]]:
    dests: Dict[str, Tuple[str, ...]] = {}
    for path, field, help_ in _leaves(cls):
        name = path[-1]
        if name in dests:
            raise RuntimeError(f"config field name {name!r} is used twice ({dests[name]} and {path})")
        dests[name] = path
        parser.add_argument(
            f"--{name}", dest=name, default=None, metavar=name.upper(), help=f"{help_} ({'.'.join(path)})"
        )
    return dests


def _set_path(data: Dict[str, Any], path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


@dataclasses.dataclass
class RoleArgs:
    """A role's command line before it becomes a config: what the user set, and any extra flags.

    ``settings`` holds only what the user gave explicitly (the YAML file, then the flags over it),
    nested like the dataclasses, so a caller can tell an explicit setting from a default."""

    parser: argparse.ArgumentParser
    settings: Dict[str, Any]
    extras: argparse.Namespace


def parse_role_args(
    cls: type,
    argv: Optional[Sequence[str]],
    prog: str,
    description: str,
    add_extras: Optional[Callable[[argparse.ArgumentParser], None]] = None,
) -> RoleArgs:
    """Parse ``--config FILE.yaml`` plus one flag per leaf field of ``cls`` (and the flags ``add_extras``
    adds) into the explicit settings; exits with the reason if the file cannot be read."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, default=None, help="a YAML file with the nested fields of this role")
    if add_extras is not None:
        add_extras(parser)
    dests = _add_arguments(parser, cls)
    args = parser.parse_args(argv)
    data: Dict[str, Any] = {}
    if args.config is not None:
        try:
            data = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            parser.error(f"cannot read config file {args.config}: {e}")
        if not isinstance(data, dict):
            parser.error(f"config file {args.config} must hold a mapping of fields")
    for name, path in dests.items():
        value = getattr(args, name)
        if value is not None:
            _set_path(data, path, _flag_value(cls, path, value))
    extras = argparse.Namespace(**{key: value for key, value in vars(args).items() if key not in dests})
    return RoleArgs(parser, data, extras)


def parse_role_config(cls: Type[T], argv: Optional[Sequence[str]], prog: str, description: str) -> T:
    """Parse ``--config FILE.yaml`` plus one flag per leaf field into ``cls``; exits with the reason on error."""
    role = parse_role_args(cls, argv, prog, description)
    try:
        return config_from_dict(cls, role.settings)
    except ConfigError as e:
        role.parser.error(f"invalid configuration: {e}")
