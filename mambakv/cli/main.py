"""The ``mambakv`` command: replay workloads through the library as an engine drives it.

    mambakv replay                      # the 480,031-token prefill on Qwen3-Next-80B-A3B
    mambakv trace TRACE.jsonl --limit 2000 [--one-at-a-time] [--json]
    mambakv chat --conversations 16 --turns 4
    mambakv fleet TRACE.jsonl --instances 4 --router kv --limit 3000
    mambakv sweep TRACE.jsonl --memory-gib 20,40,60 --layout unified,decoupled
    mambakv models

Every number printed is explained by ``mambakv <command> --help`` (REPORT_HELP in :mod:`mambakv.cli.report`; a source
checkout has more in docs/replay.md).  Bad input (missing file, malformed trace line, a
timestamp that decreases, unknown model, a bad config.json, an output file that cannot be
written, a pool too small for one request) prints one line on stderr and exits with status 2,
before any work.  A trace request longer than ``--max-model-len`` (default: the model's own
context length) is not an error: it is rejected before the run and counted in ``rejected``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from mambakv import __version__
from mambakv.cli.args import Parser
from mambakv.cli.fleet import add_fleet_arguments, run_fleet_command
from mambakv.cli.report import format_report
from mambakv.cli.runs import add_run_commands, run_command
from mambakv.cli.sweep import add_sweep_arguments
from mambakv.core.errors import MambaKVError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0].replace("``", "")  # plain text, no RST markup
    parser = Parser(prog="mambakv", description=description)
    parser.add_argument("--version", action="version", version=f"mambakv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    raw = argparse.RawDescriptionHelpFormatter
    add_run_commands(sub)
    from mambakv.cli.fleet_report import FLEET_HELP

    p = sub.add_parser("fleet", help="a Mooncake trace over N instances behind a router",
                       epilog=FLEET_HELP, formatter_class=raw)
    add_fleet_arguments(p)
    from mambakv.cli.sweep import __doc__ as sweep_doc

    p = sub.add_parser("sweep", help="hit rate and prefill saved against memory: one trace run per grid point",
                       description=(sweep_doc or "").split("\n\n")[0], epilog="Every option of `mambakv trace` "
                       "not listed here is passed to each point unchanged.", formatter_class=raw)
    add_sweep_arguments(p)
    p = sub.add_parser("models", help="the packaged model configs")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mambakv``; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "sweep":  # only sweep passes options through (to its points)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help (0) or a bad argument (2, one line already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "sweep":
            from mambakv.cli.sweep import run_sweep_command

            return _print(run_sweep_command(args, extra))
        if args.command == "models":
            from mambakv.models import format_models_table, list_models, model_info

            if args.json:
                return _print(json.dumps([model_info(n).__dict__ for n in list_models()], indent=1))
            return _print(format_models_table())
        if args.command == "fleet":
            return _print(run_fleet_command(args))
        d = run_command(args)
    except (MambaKVError, OSError) as e:
        msg = " ".join(str(e).split())
        print(f"mambakv: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mambakv: interrupted", file=sys.stderr)
        return 130
    return _print(json.dumps(d, indent=1) if args.json else format_report(d))


def _print(text: str) -> int:
    """Print `text` on stdout; a reader that went away (``mambakv replay | head -5``) ends the
    command quietly with status 141 (128 + SIGPIPE, what a shell reports for ``yes | head``)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        try:  # Python flushes stdout again at exit: point it at /dev/null so that cannot fail
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
