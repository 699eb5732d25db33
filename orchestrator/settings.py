"""Where a command's option gets its value: its flag, a ``TANDEM_*`` variable, a ``--config`` TOML file (a table per
command over the top level), or its default, in that order.

One pydantic-settings model per command validates every value, whatever its source; argparse only splits the command
line (``CommandParser``). A bad value fails the command that reads it, its error naming the flag, variable or file key
and the value, and no other command: ``TANDEM_PORT=abc tandem --help`` and ``tandem chat`` still run.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Optional

from tandem.core.errors import TandemError

ENV_PREFIX = "TANDEM_"


class ConfigError(TandemError, ValueError):
    """A configuration file or variable that cannot be honoured; the message names the key."""


@dataclass(frozen=True)
class Option:
    flag: str  # --n-ctx: the file's key is its name (n-ctx, or n_ctx), the namespace's attribute its dest
    default: Any
    type: type = str
    env: str = ""  # the variable (default: TANDEM_<FLAG>)
    choices: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return self.flag.lstrip("-")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def variable(self) -> str:
        return self.env or ENV_PREFIX + self.dest.upper()

    @property
    def field(self) -> str:  # the model's field: the variable less its prefix, which pydantic-settings adds back
        return self.variable.removeprefix(ENV_PREFIX).lower()

    def annotation(self) -> Any:
        kind: Any = Literal[self.choices] if self.choices else self.type
        return Optional[kind] if self.default is None else kind


def load_config(path: str | os.PathLike | None) -> dict[str, dict]:
    """A TOML file as ``{command: {option name: value}}`` (``""``: the top level; keys take the flags' dashes)."""
    if not path:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config {path}: {e}") from None
    out: dict[str, dict] = {"": {}}
    for key, value in data.items():
        if isinstance(value, dict):
            out[key] = {k.replace("_", "-"): v for k, v in value.items()}
        else:
            out[""][key.replace("_", "-")] = value
    return out


def check_keys(config: dict[str, dict], known: dict[str, set[str]]) -> None:
    """Every key of the file must be an option of its table's command (or, at the top level, of some command): an
    unknown one is an error for every command, never ignored (a typo would silently keep a default)."""
    anywhere = set().union(*known.values()) if known else set()
    unknown = [
        f"{table}.{k}" if table else k
        for table, values in config.items()
        for k in values
        if k not in (known.get(table, set()) if table else anywhere)
    ]
    if unknown:
        raise ConfigError(
            f"unknown config keys: {', '.join(sorted(unknown))} (known: every option that has a "
            f"TANDEM_* variable, e.g. n-ctx, http-port, in its command's table)"
        )


def _model(command: str, options: list[Option], file_values: dict[str, Any]):
    """The command's settings class: sources, highest first, the flags given (init), the environment, the file."""
    from pydantic import Field, create_model
    from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict

    class Settings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", protected_namespaces=())
        file_values: ClassVar[dict[str, Any]] = {}

        @classmethod
        def settings_customise_sources(
            cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        ):
            return init_settings, env_settings, InitSettingsSource(settings_cls, init_kwargs=cls.file_values)

    fields: dict[str, Any] = {o.field: (o.annotation(), Field(o.default)) for o in options}
    model = create_model(f"{command.title()}Settings", __base__=Settings, **fields)
    model.file_values = {o.field: file_values[o.name] for o in options if o.name in file_values}
    return model


def _source(option: Option, flags: dict[str, Any], file_values: dict[str, Any]) -> str:
    if option.field in flags:
        return option.flag
    if option.variable.lower() in {k.lower() for k in os.environ}:
        return "$" + option.variable
    return f"config key {option.name!r}" if option.name in file_values else "default"


def resolve(
    command: str, options: list[Option], flags: dict[str, Any], config: dict[str, dict]
) -> tuple[dict[str, Any], list[str]]:
    """``options``' values by dest, and the errors (each naming its source and the value refused); on any error
    every option takes its default, and the command must not run."""
    from pydantic import ValidationError

    file_values = {**config.get("", {}), **config.get(command, {})}
    by_field = {o.field: o for o in options}
    try:
        settings = _model(command, options, file_values)(**flags)
    except ValidationError as e:
        errors = []
        for err in e.errors(include_url=False):
            option = by_field[str(err["loc"][0])]
            errors.append(f"{_source(option, flags, file_values)}={err['input']!r}: {err['msg']}")
        return {o.dest: o.default for o in options}, errors
    return {o.dest: getattr(settings, o.field) for o in options}, []


class CommandParser(argparse.ArgumentParser):
    """An argparse parser whose ``option``s take their values through ``resolve`` once the command line is split.
    ``config`` is the file's values, read before the parsers are built (``load_config``)."""

    config: ClassVar[dict[str, dict]] = {}
    variables: ClassVar[dict[str, str]] = {}  # every TANDEM_* variable an option reads -> its flag

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--model` must never quietly become `--model-name`
        super().__init__(*args, **kwargs)
        self.options: list[Option] = []
        # run on the namespace once every option has its value: settles options that depend on each other (e.g.
        # serve's addresses), and returns errors as ``resolve`` does
        self.finish: Callable[[argparse.Namespace], list[str]] | None = None

    def option(
        self,
        flag: str,
        default: Any,
        type_: type = str,
        help: str = "",
        aliases: tuple[str, ...] = (),
        choices: tuple[str, ...] | None = None,
        env: str = "",
    ) -> None:
        o = Option(flag, default, type_, env, choices)
        self.options.append(o)
        CommandParser.variables[o.variable] = flag
        text = (
            f"{help} (default: {default}) [${o.variable}]" if default not in (None, "") else f"{help} [${o.variable}]"
        )
        if type_ is bool:
            self.add_argument(
                flag,
                *aliases,
                dest=o.dest,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text.strip(),
            )
        else:  # a string: its type is the model's to check, so the error names the flag like any other source's
            self.add_argument(
                flag,
                *aliases,
                dest=o.dest,
                default=argparse.SUPPRESS,
                help=text.strip(),
                metavar="{" + ",".join(choices) + "}" if choices else None,
            )

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        if self.options:
            given = vars(namespace)
            flags = {o.field: given.pop(o.dest) for o in self.options if o.dest in given}
            command = self.prog.split()[-1]
            values, errors = resolve(command, self.options, flags, CommandParser.config)
            for dest, value in values.items():
                setattr(namespace, dest, value)
            file_values = {**CommandParser.config.get("", {}), **CommandParser.config.get(command, {})}
            namespace.sources = {o.dest: _source(o, flags, file_values) for o in self.options}  # where each came from
            if not errors and self.finish is not None:
                errors = self.finish(namespace)
            namespace.config_errors = errors
        return namespace, rest

    def known_options(self) -> dict[str, set[str]]:
        """Each command (subparser) below this parser -> the names its options have in the file."""
        out: dict[str, set[str]] = {}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if isinstance(sub, CommandParser):
                        if sub.options:
                            out[name] = {o.name for o in sub.options}
                        out.update(sub.known_options())
        return out
