"""Options declared once: a dataclass field that carries its help, bounds and flag.

A field declared with ``option(default, help=..., ...)`` is an option. From
that one declaration:

- ``validate(obj)``, which every options dataclass calls in ``__post_init__``,
  checks each option against its annotation (``int``, ``float``, ``bool``,
  ``str``, a ``Literal``, ``list[...]``, a class, each optionally ``| None``),
  its bounds, choices or pattern, and raises ``OptionError`` (a
  ``ValueError``) naming the field and what it allows;
- ``add_cli_args(parser, cls)`` adds one flag per option, ``--arg-name``
  (bools as ``--x/--no-x``, a ``Literal``'s values as choices);
- ``build(cls, values)`` makes the dataclass from flat values keyed by
  argument name (an argparse namespace, ``EngineArgs``' keywords), with
  errors naming the argument.

An option's argument name is its field name unless ``arg`` says otherwise
(``CacheConfig.cache_dtype`` is ``kv_cache_dtype``, as in vLLM). Fields
declared without ``option`` are internal: no flag, no keyword, no check.
This is vLLM's way (its CLI is derived from its config dataclasses), with
the bounds in the declaration instead of hand-written checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")

_METADATA_KEY = "tokenloom.option"


@dataclass(frozen=True)
class Option:
    """What ``option`` records about a field; see ``option`` for the meaning of each."""

    help: str
    arg: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    pattern: str | None = None
    requirement: str | None = None
    parse: Callable[[Any], Any] | None = None
    metavar: str | None = None


def option(
    default: Any,
    *,
    help: str,
    arg: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    pattern: str | None = None,
    requirement: str | None = None,
    parse: Callable[[Any], Any] | None = None,
    metavar: str | None = None,
) -> Any:
    """Declare a dataclass field as an option.

    ``help``: the flag's help. ``arg``: the argument (keyword and flag) name
    where it differs from the field's. ``aliases``: more flags (``"-tp"``).
    ``choices``: allowed values (a ``Literal`` annotation gives them too).
    ``ge``/``gt``/``le``: numeric bounds. ``pattern``: a regular expression a
    string must match in full, described to users by ``requirement``.
    ``parse``: turns a flag's text (or a keyword's dict) into the field's
    value in ``build``, before validation (JSON options). ``default`` must be
    immutable (None for a list).
    """
    if pattern is not None and requirement is None:
        raise TypeError("option(pattern=...) needs a requirement that describes it to users")
    spec = Option(help, arg, aliases, choices, ge, gt, le, pattern, requirement, parse, metavar)
    return dataclasses.field(default=default, metadata={_METADATA_KEY: spec})


class OptionError(ValueError):
    """A value its option does not allow; the message starts with the name."""

    def __init__(self, name: str, requirement: str, value: object) -> None:
        super().__init__(f"{name} must be {requirement}, got {value!r}")
        self.name = name
        self.requirement = requirement
        self.value = value

    def renamed(self, name: str) -> OptionError:
        return OptionError(name, self.requirement, self.value)


@dataclass(frozen=True)
class OptionSpec:
    """One option of a dataclass with its annotation resolved."""

    name: str  # the field
    arg: str  # the keyword and flag name
    default: Any
    option: Option
    base: Any  # int, float, bool, str, list, dict, or a class
    item: Any  # a list's element type
    optional: bool
    choices: tuple[Any, ...] | None
    requirement: str  # what the option allows, for messages

    @property
    def flags(self) -> list[str]:
        return ["--" + self.arg.replace("_", "-"), *self.option.aliases]

    def accepts(self, value: object) -> bool:
        if value is None:
            return self.optional
        if not _is_a(value, self.base, self.item):
            return False
        if self.choices is not None:
            return value in self.choices
        o = self.option
        if o.pattern is not None and not (
            isinstance(value, str) and re.fullmatch(o.pattern, value)
        ):
            return False
        return (
            (o.ge is None or value >= o.ge)  # type: ignore[operator]
            and (o.gt is None or value > o.gt)  # type: ignore[operator]
            and (o.le is None or value <= o.le)  # type: ignore[operator]
        )

    def argparse_kwargs(self) -> dict[str, Any]:
        o = self.option
        help = o.help
        if self.default is not None and "default" not in help:
            help += " (default: %(default)s)"
        kwargs: dict[str, Any] = {"dest": self.arg, "default": self.default, "help": help}
        if o.metavar is not None:
            kwargs["metavar"] = o.metavar
        if self.base is bool and not self.optional:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif o.parse is not None:
            kwargs["type"] = str  # parsed by ``build``
        elif self.base is list:
            kwargs["nargs"] = "+"
            kwargs["type"] = self.item
        elif self.base in (int, float, str):
            kwargs["type"] = self.base
        if self.choices is not None:
            kwargs["choices"] = list(self.choices)
        return kwargs


def json_object(value: object, name: str, keys: Iterable[str]) -> dict[str, Any]:
    """A JSON-object option (``--speculative-config``, ``--pooler-config``,
    ``--kv-transfer-config``): its JSON text or dict as a dict whose keys are all
    in ``keys``; errors name the option and the key."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (or JSON object), got {type(value).__name__}")
    known = tuple(keys)
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ValueError(
            f"{name}.{unknown[0]} is not a supported key (supported: {', '.join(known)})"
        )
    return value


def validate(obj: object) -> None:
    """Check every option of a dataclass instance; raise ``OptionError`` for the first bad one."""
    for spec in option_specs(type(obj)):
        value = getattr(obj, spec.name)
        if not spec.accepts(value):
            raise OptionError(spec.name, spec.requirement, value)


def build(cls: type[T], values: Mapping[str, Any], **fixed: Any) -> T:
    """``cls`` from flat ``values`` keyed by argument name (missing ones: the defaults).

    ``fixed`` gives fields by their own names (nested configs, internal
    fields). An option's ``parse`` turns its value first. Errors name the
    argument, not the field.
    """
    specs = option_specs(cls)
    kwargs = dict(fixed)
    for spec in specs:
        if spec.name in fixed:
            continue
        value = values.get(spec.arg, spec.default)
        if spec.option.parse is not None and value is not None:
            value = spec.option.parse(value)
        kwargs[spec.name] = value
    try:
        return cls(**kwargs)
    except OptionError as exc:
        for spec in specs:
            if spec.name == exc.name and spec.arg != spec.name:
                raise exc.renamed(spec.arg) from None
        raise


def add_cli_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    title: str | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """One flag per option of ``cls`` (but those whose argument is in ``skip``), in one group.

    The group is titled ``title`` (default: the class name) and described by
    the first line of the class docstring.
    """
    doc = (cls.__doc__ or "").strip().splitlines()
    group = parser.add_argument_group(title or cls.__name__, doc[0] if doc else None)
    for spec in option_specs(cls):
        if spec.arg not in skip:
            group.add_argument(*spec.flags, **spec.argparse_kwargs())


_SPECS: dict[type, tuple[OptionSpec, ...]] = {}


def option_specs(cls: type) -> tuple[OptionSpec, ...]:
    """The options of dataclass ``cls``, in field order (resolved once per class)."""
    specs = _SPECS.get(cls)
    if specs is None:
        hints = typing.get_type_hints(cls, globalns=_module_globals(cls))
        specs = tuple(
            _spec(f.name, f.default, f.metadata[_METADATA_KEY], hints[f.name])
            for f in dataclasses.fields(cls)
            if _METADATA_KEY in f.metadata
        )
        _SPECS[cls] = specs
    return specs


def _module_globals(cls: type) -> dict[str, Any]:
    # The namespace the annotations were written in, from a method of the class:
    # sys.modules may no longer hold the module (benchmarks load private copies).
    for value in vars(cls).values():
        if isinstance(value, types.FunctionType):
            return value.__globals__
    return {}


def _spec(name: str, default: Any, declared: Option, hint: Any) -> OptionSpec:
    optional = False
    if typing.get_origin(hint) in (Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if len(members) != 1:
            raise TypeError(f"option {name}: only X or X | None annotations are supported")
        optional = True
        hint = members[0]
    choices = declared.choices
    item = None
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = choices or typing.get_args(hint)
        base: Any = type(typing.get_args(hint)[0])
    elif origin is not None:
        base = origin
        if origin is list:
            item = typing.get_args(hint)[0]
    else:
        base = hint
    requirement = _requirement(declared, base, item, choices, optional)
    arg = declared.arg or name
    spec = OptionSpec(name, arg, default, declared, base, item, optional, choices, requirement)
    if not spec.accepts(default):
        raise TypeError(f"option {name}: the default {default!r} is not {spec.requirement}")
    return spec


_NOUNS = {int: "an integer", float: "a number", bool: "a bool", str: "a string", dict: "a dict"}
_PLURALS = {int: "integers", float: "numbers", str: "strings"}


def _noun(base: Any) -> str:
    return _NOUNS.get(base) or f"a {getattr(base, '__name__', base)}"


def _requirement(
    o: Option, base: Any, item: Any, choices: tuple[Any, ...] | None, optional: bool
) -> str:
    if choices is not None:
        text = "one of {" + ", ".join(str(c) for c in choices) + "}"
    elif o.requirement is not None:
        text = o.requirement
    elif base is list:
        text = f"a list of {_PLURALS.get(item) or item.__name__}"
    else:
        text = _noun(base) + _bounds(o)
    return text + " or None" if optional else text


def _bounds(o: Option) -> str:
    low = f"[{_num(o.ge)}" if o.ge is not None else f"({_num(o.gt)}" if o.gt is not None else None
    if low is not None and o.le is not None:
        return f" in {low}, {_num(o.le)}]"
    if o.ge is not None:
        return f" >= {_num(o.ge)}"
    if o.gt is not None:
        return f" > {_num(o.gt)}"
    if o.le is not None:
        return f" <= {_num(o.le)}"
    return ""


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def _is_a(value: object, base: Any, item: Any) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False  # True is an int to Python, not to a user
    if base is float:
        return isinstance(value, (int, float))
    if base is list:
        return isinstance(value, list) and all(_is_a(v, item, None) for v in value)
    if base is Any:
        return True
    return isinstance(value, base)
