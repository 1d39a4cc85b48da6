"""Options generated from config dataclasses: types, choices, defaults, help, errors."""

from __future__ import annotations

import argparse
import enum
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest

from recpipe.config_cli import Option, add_config_options, docstring_attributes
from recpipe.errors import RecpipeError


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Nested:
    x: int = 1


@dataclass
class Demo:
    """A demo config.

    Attributes:
        path: where to read ``from``.
        batch_size: rows per batch,
            continued on a second line.
        lr: learning rate (default: per optimizer).
        mode: how to run; see ``batch_size``.
        color: a colour.
        widths: hidden widths.
        features: ``auto`` or feature names.
        verbose: talk more.
        fast: go fast.
        name: a name.
        ratio: 100% of it.
    """

    path: str
    batch_size: int = 64
    lr: float | None = None
    mode: Literal["a", "b"] = "a"
    color: Color = Color.RED
    widths: tuple[int, ...] = (8, 4)
    features: Literal["auto", "none"] | tuple[str, ...] = "auto"
    verbose: bool = False
    fast: bool = True
    name: str | None = None
    ratio: float = 0.5
    hidden: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            msg = f"`batch_size` must be >= 1, got {self.batch_size!r}"
            raise RecpipeError(msg)
        if self.verbose and self.name is None:
            msg = "`verbose` needs a `name`"
            raise ValueError(msg)


def _parser(**kw):
    parser = argparse.ArgumentParser(prog="demo")
    kw.setdefault("exclude", ("hidden",))
    return parser, add_config_options(parser, Demo, **kw)


def test_defaults_build_the_dataclass_defaults():
    parser, options = _parser()
    assert options.build(parser.parse_args(["p"])) == Demo(path="p")


def test_every_annotation_converts():
    parser, options = _parser()
    argv = [
        "p", "--batch-size", "8", "--lr", "0.5", "--mode", "b", "--color", "blue",
        "--widths", "3, 2,1", "--features", "f1,f2", "--verbose", "--no-fast", "--name", "n",
    ]  # fmt: skip
    got = options.build(parser.parse_args(argv))
    assert got == Demo("p", 8, 0.5, "b", Color.BLUE, (3, 2, 1), ("f1", "f2"), True, False, "n", 0.5)
    assert options.build(parser.parse_args(["p", "--features", "none"])).features == "none"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["p", "--mode", "c"], r"--mode: invalid choice: 'c'"),
        (["p", "--color", "green"], r"--color: invalid choice: 'green'"),
        (["p", "--widths", "1,x"], r"--widths: expected a comma-separated list"),
        (["p", "--batch-size", "x"], r"--batch-size: invalid int value"),
    ],
)
def test_bad_values_are_argparse_errors(argv, match, capsys):
    parser, _ = _parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["p", "--batch-size", "0"], "`--batch-size` must be >= 1, got 0"),
        (["p", "--verbose"], "`--verbose` needs a `--name`"),
    ],
)
def test_post_init_errors_become_usage_errors_naming_the_option(argv, message, capsys):
    parser, options = _parser()
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit) as exc:
        options.build(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: demo") and f"demo: error: {message}" in err


def test_help_comes_from_the_docstring_with_defaults(capsys):
    parser, _ = _parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "PATH where to read from" in out
    assert "rows per batch, continued on a second line (default 64)" in out
    assert "learning rate (default: per optimizer)" in out  # not a second default
    assert "how to run; see --batch-size (default a)" in out
    assert "--widths A,B,... hidden widths (default 8,4)" in out
    assert "--fast, --no-fast go fast (default on)" in out
    assert "100% of it (default 0.5)" in out
    assert "--mode {a,b}" in out and "--color {red,blue}" in out


def test_overrides_exclusive_groups_include_and_prefix(capsys):
    parser = argparse.ArgumentParser(prog="demo")
    options = add_config_options(
        parser,
        Demo,
        include=("path", "batch_size", "verbose", "fast", "name"),
        overrides={
            "fast": Option(choices={"on": True, "off": False}),
            "name": Option(flag="--who", metavar="WHO", help="who runs it"),
        },
        exclusive=[("verbose", "batch_size")],
        prefix="demo_",
    )
    args = parser.parse_args(["p", "--fast", "off", "--who", "me"])
    assert args.demo_fast is False and args.demo_name == "me"
    assert options.build(args) == Demo("p", fast=False, name="me")
    with pytest.raises(SystemExit):
        parser.parse_args(["p", "--verbose", "--batch-size", "3"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_mistakes_in_the_call_are_refused():
    parser = argparse.ArgumentParser()
    with pytest.raises(ValueError, match=r"has no field\(s\) \['nope'\]"):
        add_config_options(parser, Demo, exclude=("nope",))
    with pytest.raises(TypeError, match="must be a dataclass"):
        add_config_options(parser, int)

    @dataclass
    class Outer:
        inner: Nested = field(default_factory=Nested)

    with pytest.raises(TypeError, match="nested dataclass"):
        add_config_options(argparse.ArgumentParser(), Outer)
    with pytest.raises(TypeError, match="no command-line form"):
        add_config_options(argparse.ArgumentParser(), Demo)  # list[int] of `hidden`


def test_docstring_attributes_reads_args_sections_and_stops_at_the_next_section():
    class C:
        """Doc.

        Args:
            a: first.
            b (int): second,
                continued.

        Raises:
            ValueError: never an option.
        """

    assert docstring_attributes(C) == {"a": "first.", "b": "second, continued."}
