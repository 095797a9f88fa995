"""`plait` command line.

- `plait serve [--model-path PATH] [--port N] ...`: every ServerArgs field is a flag, generated from the
  dataclass (flags.py), so a setting is declared in exactly one place. With `--node-rank N` (N > 0)
  the machine runs its share of a model's ranks for node 0's server and serves no HTTP itself.
- `plait router --worker-urls URL [URL ...] ...`: replicas behind one address (RouterArgs' flags).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..distributed.topology import lws_defaults
from ..router.args import RouterArgs
from ..server_args import ServerArgs
from .flags import CLI_CHOICES, CLI_HELP, ROUTER_CLI_CHOICES, ROUTER_CLI_HELP, add_dataclass_flags, settings_from_args

COMMANDS = ("serve", "router")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plait", description="plait: structured LLM programs and runtime")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="launch the HTTP server (SGLang native + OpenAI APIs)",
        description="Launch the HTTP server. With no model named, the embedded "
        "default (SmolLM2-135M-Instruct) is served.",
    )
    serve.add_argument("--model", dest="model_path", type=str, default=None, help="alias of --model-path")
    add_dataclass_flags(serve, ServerArgs, CLI_HELP, CLI_CHOICES)
    serve.set_defaults(**lws_defaults())  # inside a LeaderWorkerSet pod: its group is the model's nodes
    router = commands.add_parser(
        "router",
        help="route requests over replicas by prefix-cache affinity",
        description="One address in front of several `plait serve` replicas: each request "
        "goes to the replica most likely to hold its prefix in cache.",
    )
    add_dataclass_flags(router, RouterArgs, ROUTER_CLI_HELP, ROUTER_CLI_CHOICES)
    return parser


def parse_server_args(argv: Sequence[str]) -> ServerArgs:
    """ServerArgs from `serve` flags; invalid values exit with argparse's usage error."""
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    try:
        return settings_from_args(ServerArgs, args)
    except ValueError as e:  # a bad value, or settings that cannot work together
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def parse_router_args(argv: Sequence[str]) -> RouterArgs:
    parser = build_parser()
    args = parser.parse_args(["router", *argv])
    try:
        return settings_from_args(RouterArgs, args)
    except ValueError as e:
        parser.error(str(e))
        raise


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    if argv[0] == "router":
        from ..router.app import launch_router  # lazy: FastAPI and aiohttp load only for `router`

        launch_router(parse_router_args(argv[1:]))
        return 0
    server_args = parse_server_args(argv[1:])
    if server_args.node_rank > 0:
        import logging

        from ..distributed.launch import serve_node

        logging.basicConfig(
            level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        return serve_node(server_args, server_args.model_path)
    from ..server.launch import launch_server  # lazy: the Engine (and FastAPI, beside it) load only for `serve`

    launch_server(server_args)
    return 0
