"""Command-line options generated from a config dataclass: one source of truth for every option.

A command's options are the fields of its config dataclass: the option name is the field name
(``batch_size`` -> ``--batch-size``), the type, choices and default come from the annotation and
the field's default, and the help text is the field's entry in the class docstring's Google-style
``Attributes:`` (or ``Args:``) section. Checks stay where they are, in the dataclass's
``__post_init__``: a value it refuses (``RecpipeError`` or ``ValueError``) becomes an ordinary argparse error (usage line, exit status
2) quoting its message, with the field names in it turned into option names.

Converting a command (what ``recpipe train`` does)::

    from recpipe.config_cli import Option, add_config_options

    def register_cli(subparsers):
        parser = subparsers.add_parser("train", help=..., description=...)
        options = add_config_options(
            parser,
            TrainConfig,                      # a dataclass importing nothing heavy
            exclude=("model",),               # fields the command does not expose
            overrides={"dedup": Option(choices={"on": True, "off": False})},
            exclusive=[("steps", "epochs")],  # mutually exclusive options
        )
        parser.add_argument("--json", ...)  # options that are not config fields, as usual
        parser.set_defaults(func=lambda args: run(options.build(args)))

How a field becomes an option (``X | None`` is ``X`` with the default ``None``):

=========================  ===================================================================
annotation                 option
=========================  ===================================================================
no default                 a positional argument (metavar: the name in capitals)
``bool``                   ``--name`` if the default is ``False``, ``--name/--no-name`` if not
``int``, ``float``, ``str``  ``--name VALUE`` of that type
``Literal["a", "b"]``      ``--name {a,b}``
an ``Enum``                ``--name {value,...}``, converted to the member
``tuple[int, ...]``        ``--name 1,2,3`` (comma-separated)
``Literal[...] | tuple``   a choice, or else a comma-separated list
a nested dataclass         skipped: list it in ``exclude`` (or call again with its class)
=========================  ===================================================================

An ``int`` must fit in 64 bits and a ``float`` must not be NaN (NaN passes every range check
in ``__post_init__``); anything else is the dataclass's to check.

:class:`Option` overrides what a field needs differently (name, metavar, help, choices mapped to
values, ``type``). The module imports only the standard library and :mod:`recpipe.errors`, so
every layer (``etl`` included) can use it.

>>> import argparse
>>> from dataclasses import dataclass
>>> @dataclass
... class Demo:
...     '''A demo.
...
...     Attributes:
...         path: where to read.
...         batch_size: rows per batch.
...     '''
...     path: str
...     batch_size: int = 64
>>> parser = argparse.ArgumentParser(prog="demo")
>>> options = add_config_options(parser, Demo)
>>> options.build(parser.parse_args(["data", "--batch-size", "8"]))
Demo(path='data', batch_size=8)
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from recpipe.errors import RecpipeError

__all__ = [
    "ConfigOptions",
    "Option",
    "add_config_options",
    "add_quiet_option",
    "docstring_attributes",
    "finite_float",
    "non_negative_int",
    "positive_int",
]

_T = TypeVar("_T")

_SECTION = re.compile(r"^(\s*)(Attributes|Args|Arguments|Parameters):\s*$")
_ENTRY = re.compile(r"^(\s*)([A-Za-z_][\w, ]*?)(?:\s*\([^)]*\))?:\s*(.*)$")


_KEEP: Any = type("_Keep", (), {"__repr__": lambda self: "<the field's default>"})()


@dataclasses.dataclass(frozen=True)
class Option:
    """How one field differs from the generated option (every attribute is optional).

    Attributes:
        flag: the option string, e.g. ``"--dim"`` (default ``--field-name``).
        metavar: the value's placeholder in the help, e.g. ``"DIR"``.
        help: the help text (default: the field's docstring entry).
        choices: the accepted strings, mapped to the field's values (e.g. ``{"on": True}``).
        type: converts the string to the field's value (default: from the annotation).
        default: the option's default, when a command's differs from the field's (e.g. a
            ``bool`` field off by default that a command turns on: ``--name/--no-name``).
    """

    flag: str | None = None
    metavar: str | None = None
    help: str | None = None
    choices: Mapping[str, Any] | None = None
    type: Callable[[str], Any] | None = None
    default: Any = _KEEP


def docstring_attributes(cls: type, *, raw: bool = False) -> dict[str, str]:
    """Field name -> description, from the ``Attributes:`` or ``Args:`` section of the docstring.

    Continuation lines join their entry; ``a, b: text`` describes both; Sphinx roles and double
    backticks are reduced to plain text (unless ``raw``).

    >>> class C:
    ...     '''Doc.
    ...
    ...     Attributes:
    ...         a: the ``first`` one,
    ...             continued.
    ...         b, c: see :class:`C`.
    ...     '''
    >>> docstring_attributes(C)
    {'a': 'the first one, continued.', 'b': 'see C.', 'c': 'see C.'}
    """
    out: dict[str, str] = {}
    section_indent: int | None = None
    entry_indent: int | None = None
    names: list[str] = []
    for line in (cls.__doc__ or "").splitlines():
        section = _SECTION.match(line)
        if section:
            section_indent, entry_indent, names = len(section.group(1)), None, []
            continue
        if section_indent is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= section_indent:  # the section ended
            section_indent = None
            continue
        entry = _ENTRY.match(line)
        if entry and (entry_indent is None or indent == entry_indent):
            entry_indent = indent
            names = [n.strip() for n in entry.group(2).split(",") if n.strip()]
            for name in names:
                out[name] = entry.group(3).strip()
        elif names:
            for name in names:
                out[name] = f"{out[name]} {line.strip()}".strip()
    return out if raw else {name: _plain(text) for name, text in out.items()}


def _plain(text: str) -> str:
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).split(".")[-1], text)
    return text.replace("``", "")


def _help_text(text: str, fields: Iterable[str]) -> str:
    """A docstring entry as help: ````field```` becomes ``--field``, ``%`` is escaped."""
    names = set(fields)
    text = re.sub(
        r"``(\w+)``", lambda m: _flag(m.group(1)) if m.group(1) in names else m.group(0), text
    )
    return _plain(text).rstrip(".").replace("%", "%%")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(hint, False)``."""
    args = typing.get_args(hint)
    if _is_union(hint) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007
    return hint, False


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _is_tuple_of(hint: Any) -> bool:
    args = typing.get_args(hint)
    return typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis


def _scalar_type(hint: Any) -> Callable[[str], Any]:
    if hint is int:
        return _int
    if hint is float:
        return _float
    if hint is str:
        return str
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    msg = f"no command-line form for the annotation {hint!r}: give an `Option(type=...)`"
    raise TypeError(msg)


def _converter(hint: Any) -> tuple[Callable[[str], Any], tuple[str, ...] | None, str | None]:
    """``(type, choices shown, metavar)`` of an annotation (see the module's table)."""
    if typing.get_origin(hint) is typing.Literal:
        values = typing.get_args(hint)
        by_text = {str(v): v for v in values}
        return _choice(by_text), tuple(by_text), None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        by_text = {str(m.value): m for m in hint}
        return _choice(by_text), tuple(by_text), None
    if _is_tuple_of(hint):
        item = _scalar_type(typing.get_args(hint)[0])
        return _comma_list(item), None, "A,B,..."
    if _is_union(hint):
        literals = [a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal]
        tuples = [a for a in typing.get_args(hint) if _is_tuple_of(a)]
        if len(literals) == 1 and len(tuples) == 1:
            words = {str(v): v for v in typing.get_args(literals[0])}
            as_list = _comma_list(_scalar_type(typing.get_args(tuples[0])[0]))
            metavar = "{" + ",".join(words) + "} or A,B,..."
            return (lambda text: words[text] if text in words else as_list(text)), None, metavar
    return _scalar_type(hint), None, None


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _int(text: str, *, low: int = _INT64[0], what: str = "") -> int:
    """An ``int`` field's value: what fits in 64 bits (NumPy, torch and DuckDB take no more),
    and at least ``low`` (then ``what`` it must be)."""
    value = _parse(text, int)
    if value < low:
        msg = f"must be {what}, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    if value > _INT64[1] or value < _INT64[0]:
        msg = f"{text!r} does not fit in a 64-bit integer"
        raise argparse.ArgumentTypeError(msg)
    return value


def _float(text: str, *, finite: bool = False) -> float:
    """A ``float`` field's value: any number but NaN (which passes every range check), and
    with ``finite`` not infinite either."""
    value = _parse(text, float)
    if math.isnan(value) or (finite and math.isinf(value)):
        msg = f"must be a {'finite ' if finite else ''}number, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _parse(text: str, kind: Callable[[str], _T]) -> _T:
    try:
        return kind(text)
    except ValueError:
        msg = f"invalid {getattr(kind, '__name__', 'number')} value: {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _choice(by_text: Mapping[str, Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if text not in by_text:
            msg = f"invalid choice: {text!r} (choose from {', '.join(map(repr, by_text))})"
            raise argparse.ArgumentTypeError(msg)
        return by_text[text]

    return convert


def _comma_list(item: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def convert(text: str) -> tuple[Any, ...]:
        try:
            return tuple(item(part.strip()) for part in text.split(",") if part.strip())
        except (ValueError, argparse.ArgumentTypeError) as exc:
            msg = f"expected a comma-separated list, got {text!r}: {exc}"
            raise argparse.ArgumentTypeError(msg) from None

    return convert


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "(none)"
    return str(value)


class ConfigOptions:
    """The options :func:`add_config_options` added; :meth:`build` makes the config from them."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        cls: type,
        fields: Sequence[str],
        *,
        prefix: str,
        flags: Mapping[str, str] | None = None,
    ) -> None:
        self.parser = parser
        self.cls = cls
        self.fields = tuple(fields)
        self.prefix = prefix
        self.flags = {name: _flag(name) for name in self.fields} | dict(flags or {})

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """``{field: value}`` of the parsed options."""
        return {name: getattr(args, self.prefix + name) for name in self.fields}

    def build(self, args: argparse.Namespace, **extra: Any) -> Any:
        """The config from the parsed options (and ``extra`` fields, e.g. a nested config).

        A :class:`~recpipe.errors.RecpipeError` or ``ValueError`` from the dataclass (its
        ``__post_init__`` checks) becomes ``parser.error``: the usage line and the message,
        exit status 2, with the fields named as their options (an ``extra`` field too, when
        the parser has an option of that ``dest``, e.g. one added by hand).
        """
        try:
            return self.cls(**self.values(args), **extra)
        except (RecpipeError, ValueError) as exc:
            by_hand = {
                action.dest: action.option_strings[-1]
                for action in self.parser._actions
                if action.dest in extra and action.option_strings
            }
            self.parser.error(self._with_flags(str(exc), by_hand))

    def _with_flags(self, message: str, more: Mapping[str, str] | None = None) -> str:
        for name, flag in {**self.flags, **(more or {})}.items():
            message = message.replace(f"`{name}`", f"`{flag}`")
        return message


def add_config_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    exclude: Iterable[str] = (),
    include: Iterable[str] | None = None,
    overrides: Mapping[str, Option] | None = None,
    exclusive: Iterable[Sequence[str]] = (),
    owner: argparse.ArgumentParser | None = None,
    prefix: str = "",
) -> ConfigOptions:
    """Add one option per field of the dataclass ``cls`` to ``parser`` (see the module doc).

    Args:
        parser: the parser, or an argument group of it (then give ``owner``).
        cls: the config dataclass; its annotations must resolve in its module.
        exclude: fields not to expose (they keep their defaults unless given to ``build``).
        include: expose only these fields (in the dataclass's order).
        overrides: field -> :class:`Option` for the few that differ from the generated form.
        exclusive: groups of fields of which at most one may be given.
        owner: the parser ``parser`` belongs to, when ``parser`` is a group (for errors).
        prefix: prepended to every ``dest`` (to add two configs with overlapping field names).

    Returns:
        The :class:`ConfigOptions`, whose ``build(args)`` makes the config.

    Raises:
        TypeError: ``cls`` is not a dataclass, or a field's annotation has no command-line form.
        ValueError: ``exclude``, ``include``, ``overrides`` or ``exclusive`` name no field.
    """
    if not dataclasses.is_dataclass(cls):
        msg = f"`cls` must be a dataclass, got {cls!r}"
        raise TypeError(msg)
    overrides = dict(overrides or {})
    exclude = set(exclude)
    module = sys.modules.get(cls.__module__)
    hints = typing.get_type_hints(cls, vars(module) if module else None)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    known = {f.name for f in fields}
    mentioned = {*exclude, *(include or ()), *overrides, *(n for g in exclusive for n in g)}
    unknown = sorted(mentioned - known)
    if unknown:
        msg = f"{cls.__name__} has no field(s) {unknown}; it has {sorted(known)}"
        raise ValueError(msg)
    if include is not None:
        wanted = set(include)
        fields = [f for f in fields if f.name in wanted]
    fields = [f for f in fields if f.name not in exclude]
    docs = {
        name: _help_text(text, (f.name for f in fields))
        for name, text in docstring_attributes(cls, raw=True).items()
    }
    groups = {name: parser.add_mutually_exclusive_group() for g in exclusive for name in g[:1]}
    group_of = {name: groups[g[0]] for g in exclusive for name in g}
    flags = {}
    for f in fields:
        target = group_of.get(f.name, parser)
        override = overrides.get(f.name)
        _add_field(target, f, hints[f.name], docs.get(f.name, ""), override, prefix)
        if _default_of(f) is dataclasses.MISSING:  # a positional: named by its metavar
            flags[f.name] = (override and override.metavar) or f.name.upper()
        else:
            flags[f.name] = (override and override.flag) or _flag(f.name)
    main_parser = owner if owner is not None else parser
    if not isinstance(main_parser, argparse.ArgumentParser):
        msg = "`owner` must be given when `parser` is an argument group"
        raise TypeError(msg)
    names = [f.name for f in fields]
    return ConfigOptions(main_parser, cls, names, prefix=prefix, flags=flags)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _add_field(
    parser: Any,
    f: dataclasses.Field[Any],
    hint: Any,
    doc: str,
    override: Option | None,
    prefix: str,
) -> None:
    override = override or Option()
    default = _default_of(f) if override.default is _KEEP else override.default
    dest = prefix + f.name
    base, _ = _split_optional(hint)
    help_text = override.help if override.help is not None else doc
    if dataclasses.is_dataclass(base):
        msg = f"field `{f.name}` is a nested dataclass: exclude it or add its own options"
        raise TypeError(msg)
    if default is dataclasses.MISSING:  # required: positional
        convert, _, _ = _converter(base)
        parser.add_argument(
            dest,
            metavar=override.metavar or f.name.upper(),
            type=override.type or convert,
            help=help_text,
        )
        return
    flag = override.flag or _flag(f.name)
    kwargs: dict[str, Any] = {"dest": dest, "default": default}
    if override.choices is not None:
        by_text = dict(override.choices)
        shown = next((t for t, v in by_text.items() if v == default), _shown(default))
        kwargs["type"] = _choice(by_text)
        kwargs["metavar"] = override.metavar or "{" + ",".join(by_text) + "}"
        parser.add_argument(flag, help=_with_default(help_text, shown), **kwargs)
        return
    if base is bool and override.type is None:
        if default:
            kwargs["action"] = argparse.BooleanOptionalAction
            help_text = _with_default(help_text, "on")
        else:
            kwargs["action"] = "store_true"
        parser.add_argument(flag, help=help_text, **kwargs)
        return
    if override.type is None:
        convert, choices, metavar = _converter(base)
        kwargs["type"] = convert
    else:
        choices, metavar = None, None
        kwargs["type"] = override.type
    kwargs["metavar"] = override.metavar or (
        "{" + ",".join(choices) + "}" if choices else metavar or f.name.upper()
    )
    if default is not None:
        help_text = _with_default(help_text, _shown(default))
    parser.add_argument(flag, help=help_text, **kwargs)


def _with_default(help_text: str, shown: str) -> str:
    if "(default" in help_text:
        return help_text
    return f"{help_text} (default {shown})" if help_text else f"(default {shown})"


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1 (a count, a size).

    >>> positive_int("8")
    8
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a positive integer, got '0'
    """
    return _int(text, low=1, what="a positive integer")


def non_negative_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 0 (0 usually meaning "none" or "off").

    >>> non_negative_int("0")
    0
    >>> non_negative_int("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be an integer >= 0, got '-1'
    """
    return _int(text, low=0, what="an integer >= 0")


def finite_float(text: str) -> float:
    """An ``argparse`` type: a float that is not NaN or infinite.

    >>> finite_float("0.5")
    0.5
    >>> finite_float("nan")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a finite number, got 'nan'
    """
    return _float(text, finite=True)


def add_quiet_option(
    parser: argparse.ArgumentParser, *, aliases: Sequence[str] = ("--no-progress",)
) -> None:
    """Add ``--quiet``, the one spelling of "no progress bars" in every ``recpipe`` command.

    It sets ``args.quiet``: no progress bars or progress lines, and only warnings and errors
    logged (``recpipe --quiet <command>`` sets it for any command). ``aliases`` are older
    spellings still accepted, hidden from ``--help``.

    >>> parser = argparse.ArgumentParser(prog="demo")
    >>> add_quiet_option(parser)
    >>> parser.parse_args(["--no-progress"]).quiet
    True
    """
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars or progress lines; log only warnings and errors",
    )
    for flag in aliases:
        parser.add_argument(flag, dest="quiet", action="store_true", help=argparse.SUPPRESS)
