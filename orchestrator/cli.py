"""``tandem`` command line: fetch models, run a verifier, chat through the edge, or all of it at once (``demo``).

This module parses (``cli_args``: the parsers; ``settings``: where each option's value comes from) and dispatches to
the command's home: ``model_commands`` (models, drafter), ``compose`` (serve), ``terminal_chat`` (chat), ``health``,
``demo``."""
from __future__ import annotations

import argparse
import os
import sys

from tandem.core import lifetime, logs
from tandem.core.llama_cpu import LlamaError

from . import demo, health, model_commands, models, terminal_chat
from .cli_args import ENV_KEYS, OTHER_ENV_KEYS, auto_gateway_drafters, env_keys, parser
from .settings import CommandParser, ConfigError, check_keys, load_config
from .terminal_chat import unescape

__all__ = ["ENV_KEYS", "OTHER_ENV_KEYS", "auto_gateway_drafters", "env_keys", "main", "parser", "unescape"]


def cmd_serve(args) -> int:
    """A verifier (local engine or Ray pool) on gRPC (--grpc-host/--grpc-port), plus the REST gateway (--host/--port);
    or, with --verifier, the gateway alone in front of a verifier elsewhere: ``serve_config`` types and checks the
    options, ``compose`` runs them."""
    from tandem.core.auth import AuthConfigError
    from tandem.core.tenancy import SaltError

    from . import compose
    from .serve_config import ServeConfig

    try:
        config = ServeConfig.load(args)
    except (models.ModelError, AuthConfigError, SaltError, ConfigError) as e:
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2
    return compose.serve(config)


def cmd_chat(args) -> int:
    return terminal_chat.chat(args, args.verifier)


# each command (with its subcommand) -> what runs it
HANDLERS = {
    "models fetch": model_commands.models_fetch,
    "models list": model_commands.models_list,
    "models check": model_commands.models_check,
    "serve": cmd_serve,
    "chat": cmd_chat,
    "drafter export": model_commands.drafter_export,
    "drafter vocabtrim": model_commands.drafter_vocabtrim,
    "health": health.check,
    "demo": demo.run,
}


def _handler(args: argparse.Namespace):
    sub = getattr(args, f"{args.command}_command", None)
    return HANDLERS[f"{args.command} {sub}" if sub else args.command]


def _config_path(argv: list[str]) -> str | None:
    """``--config`` is read before the parser is built: its values become the options' defaults."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=os.environ.get("TANDEM_CONFIG"))
    return pre.parse_known_args(argv)[0].config


def main(argv: list[str] | None = None) -> int:
    lifetime.bind_to_parent()
    argv = sys.argv[1:] if argv is None else argv
    try:
        CommandParser.config = load_config(_config_path(argv))
        ap = parser()
        check_keys(CommandParser.config, ap.known_options())
    except ConfigError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    args = ap.parse_args(argv)
    if errors := getattr(args, "config_errors", None):  # this command's own options were set badly
        for err in errors:
            print(f"tandem: {err}", file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    try:
        return _handler(args)(args)
    except (models.ModelError, LlamaError) as e:  # a model that is missing or will not load: one line, no traceback
        print(f"tandem {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
