"""Map frozen config dataclasses one-to-one onto argparse flags, and the CLIs' log handler.

A field ``sync_every`` becomes ``--sync-every``; its help text is the one-line docstring written
under the field, so the flag, the config field and the docs can never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import sys
import textwrap
import types
import typing
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")


def command_parser(
    prog: str, doc: str, commands: dict[str, str]
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """A parser of required subcommands (``commands``: name -> help), with the first line of ``doc`` as its
    description; returns it and the subcommands' parsers by name."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    return parser, {name: sub.add_parser(name, help=text) for name, text in commands.items()}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its attribute docstring)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                    docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _is_part(field: dataclasses.Field) -> bool:
    """A nested config dataclass (its fields become flags of their own)."""
    return field.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(field.default_factory)


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (), defaults: Any = None
) -> None:
    """Add one flag per field of ``cls`` (except ``skip``), and of each nested config part (its own group);
    defaults come from the dataclass, or from ``defaults`` (an instance, for a part)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        if _is_part(field):
            add_dataclass_arguments(parser, field.default_factory, skip=skip, defaults=field.default_factory())
            continue
        tp, optional = _unwrap_optional(hints[field.name])
        kwargs: dict[str, Any] = {"dest": field.name, "help": docs.get(field.name, "")}
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if defaults is not None:
            kwargs["default"] = getattr(defaults, field.name)
            kwargs["help"] += " (default: %(default)s)"
        elif required:
            kwargs["required"] = True
        else:
            kwargs["default"] = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            kwargs["help"] += " (default: %(default)s)"
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is tuple:
            (item_type, *_) = typing.get_args(tp)
            kwargs.update(nargs="*" if not required else "+", type=item_type, metavar=field.name.upper())
        elif typing.get_origin(tp) is typing.Literal:
            kwargs.update(type=str, choices=typing.get_args(tp), metavar=field.name.upper())
            kwargs["help"] += " (one of: %(choices)s)"
        else:
            kwargs.update(type=tp, metavar=field.name.upper())
            if optional and "default" not in kwargs:
                kwargs["default"] = None
        group.add_argument(flag_name(field.name), **kwargs)


def dataclass_from_args(cls: type[T], namespace: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` (and its nested parts) from parsed flags; ``overrides`` win. Tuples stay tuples."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in overrides:
            values[field.name] = overrides[field.name]
        elif _is_part(field):
            values[field.name] = dataclass_from_args(field.default_factory, namespace, **overrides)
        elif hasattr(namespace, field.name):
            value = getattr(namespace, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def dataclass_flags(cls: type, *, skip: tuple[str, ...] = ()) -> list[str]:
    flags = []
    for field in dataclasses.fields(cls):
        if _is_part(field):
            flags += dataclass_flags(field.default_factory, skip=skip)
        elif field.name not in skip:
            flags.append(flag_name(field.name))
    return flags


@cache
def stderr_console() -> Any:
    """The process's one rich console on stderr, shared by the log handler and the progress line so that
    log records are drawn above the live line instead of through it."""
    from rich.console import Console

    return Console(stderr=True)


def log_handler() -> logging.Handler:
    """The CLIs' log handler: rich's on a terminal (stderr); plain one-line records with a timestamp when
    stderr is a file or a pipe (rich would hard-wrap them at 80 columns, splitting peer IDs)."""
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler = RichHandler(console=stderr_console(), show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


def default_log_handler(logger_name: str) -> None:
    """Give ``logger_name`` the CLIs' handler at INFO when the application has configured no logging (a
    library's records would otherwise show only from WARNING up, through Python's last-resort handler)."""
    own = logging.getLogger(logger_name)
    if logging.getLogger().handlers or own.handlers:
        return
    own.addHandler(log_handler())
    own.setLevel(logging.INFO)
