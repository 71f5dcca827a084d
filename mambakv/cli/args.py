"""Argument types of the ``mambakv`` command: finite numbers in a range, a parser whose errors
are one line with exit status 2, and the progress bar."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

__all__ = ["COUNT", "NON_NEGATIVE", "POSITIVE", "POSITIVE_INT", "PROBABILITY", "Parser", "add_max_model_len_argument",
           "check_output_path", "number", "progress", "warn", "warn_rejected"]

_Num = TypeVar("_Num", int, float)


def number(kind: Callable[[str], _Num], *, low: float, low_ok: bool,
            high: float | None = None) -> Callable[[str], _Num]:
    """An argparse ``type=`` parser: a finite `kind` (int or float) in ``[low, high]`` (``(low, high]``
    when not `low_ok`); anything else is argparse's one-line error."""
    if kind is int:
        what = f"an int >= {low:g}" if low_ok else f"an int > {low:g}"
    elif high is not None:
        what = f"a number in [{low:g}, {high:g}]"
    else:
        what = f"a finite number {'>=' if low_ok else '>'} {low:g}"

    def parse(text: str) -> _Num:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or v < low or (v == low and not low_ok) or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


POSITIVE_INT = number(int, low=0, low_ok=False)
COUNT = number(int, low=0, low_ok=True)
POSITIVE = number(float, low=0, low_ok=False)
NON_NEGATIVE = number(float, low=0, low_ok=True)
PROBABILITY = number(float, low=0, low_ok=True, high=1)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``mambakv: error: ...``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"mambakv: error: {' '.join(message.split())} (see {self.prog} --help)\n")




def warn(message: str) -> None:
    """One line ``mambakv: warning: ...`` on stderr."""
    print(f"mambakv: warning: {' '.join(message.split())}", file=sys.stderr)


def warn_rejected(rejected: int, requests: int, max_model_len: int) -> None:
    """The warning line of a run (trace, fleet) that rejected requests longer than max_model_len."""
    warn(f"{rejected:,} of {requests:,} requests rejected: prompt + output tokens exceed max_model_len "
         f"{max_model_len:,} (--max-model-len)")


def check_output_path(path: str | None, flag: str) -> None:
    """Refuse a file the command would write after the run (``--plot``, ``--save-hazard-table``)
    before any work: `path` is a directory, its folder does not exist, or a test write there
    fails (a folder that is not writable, a read-only or virtual file system such as
    ``/proc``).  The test write opens an existing file for appending (nothing written, its
    content kept) or creates the file and removes it again.

    Raises:
        InvalidSpecError: one line, ``FLAG PATH: why``.
    """
    from pathlib import Path

    from mambakv.core.errors import InvalidSpecError

    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InvalidSpecError(f"{flag} {path}: is a directory")
    folder = p.parent
    if not folder.is_dir():
        raise InvalidSpecError(f"{flag} {path}: folder {folder} does not exist")
    try:
        if p.exists():
            with open(p, "ab"):
                pass
        else:
            with open(p, "xb"):
                pass
            os.unlink(p)
    except OSError as e:
        raise InvalidSpecError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def add_max_model_len_argument(p: argparse.ArgumentParser) -> None:
    """``--max-model-len`` (trace, fleet)."""
    p.add_argument("--max-model-len", type=POSITIVE_INT, default=None, metavar="TOKENS",
                   help="longest request, prompt + output tokens: a longer one is rejected before the run and "
                        "counted as rejected (default: the model's own context length, max_position_embeddings "
                        "of its config.json, e.g. 262,144 for qwen3-next-80b-a3b; 2,097,152 for a config "
                        "without one)")


def progress(total: int, quiet: bool) -> Any:
    """A tqdm bar on a terminal (None when quiet, for one item, or off a terminal)."""
    if quiet or total < 2 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)


def add_host_arguments(p: argparse.ArgumentParser) -> None:
    """``--host-memory-gib``, ``--host-write``, ``--host-eviction``, ``--h2d-gbps`` (a host tier; block ids only)."""
    p.add_argument("--host-memory-gib", type=POSITIVE, default=None, metavar="GIB",
                   help="a host-memory tier of GIB GiB holding evicted or freed units (a state and its pages); "
                        "block ids only, no host memory is allocated (default: none)")
    p.add_argument("--host-write", choices=("through", "evict"), default=None,
                   help="when units go to the host tier: through (when a request is freed; default) or evict "
                        "(when the GPU tier evicts them; --layout decoupled)")
    p.add_argument("--host-eviction", choices=("lru", "reuse"), default=None,
                   help="the host tier's own eviction policy over its units (default lru: on the Mooncake "
                        "conversation trace with a 256 GiB host tier, reuse scored 0.2434 and lru 0.2493)")
    p.add_argument("--h2d-gbps", type=POSITIVE, default=None, metavar="GBPS",
                   help="host-to-GPU bandwidth in GB/s: a request whose hit needs a load waits for it on the "
                        "simulated clock (default 25)")


def host_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The host tier's keywords of a run (defaults: through, lru, 25 GB/s), checked before it.

    Raises:
        InvalidSpecError: a host flag without ``--host-memory-gib`` (it would do nothing).
    """
    from mambakv.core.errors import InvalidSpecError
    given = [f for f, v in (("--host-write", args.host_write), ("--host-eviction", args.host_eviction),
                            ("--h2d-gbps", args.h2d_gbps)) if v is not None]
    if given and args.host_memory_gib is None:
        raise InvalidSpecError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --host-memory-gib (there is "
                               f"no host tier without it)")
    return {"host_memory_gib": args.host_memory_gib, "host_write": args.host_write or "through",
            "host_eviction": args.host_eviction, "h2d_gbps": 25.0 if args.h2d_gbps is None else args.h2d_gbps}


def add_eviction_arguments(p: argparse.ArgumentParser) -> None:
    """``--eviction``, ``--hazard-table``, ``--save-hazard-table`` (decoupled layout)."""
    p.add_argument("--eviction", choices=("reuse", "lru"), default=None,
                   help="decoupled layout: which eviction unit (a state and its pages) goes first: reuse (the "
                        "default: lowest learned hit density per byte) or lru; the unified layout is LRU")
    p.add_argument("--hazard-table", metavar="JSON", default=None,
                   help="warm-start the reuse policy from a table written by --save-hazard-table")
    p.add_argument("--save-hazard-table", metavar="JSON", default=None,
                   help="write the reuse policy's learned hazard table after the run")


def save_hazard_table(coord: Any, path: str) -> None:
    """``--save-hazard-table``: write the reuse policy's learned table to `path` (``wrote PATH``
    on stderr). Raises InvalidSpecError: the run had no reuse policy (lru, unified)."""
    from mambakv.core.errors import InvalidSpecError

    hazard = getattr(coord.units.policy, "hazard", None) if coord.units is not None else None
    if hazard is None:
        raise InvalidSpecError("--save-hazard-table needs the reuse eviction policy (--layout decoupled)")
    hazard.save(path)
    print(f"wrote {path}", file=sys.stderr)


def add_oracle_argument(p: argparse.ArgumentParser) -> None:
    """``--oracle-hints`` (trace)."""
    p.add_argument("--oracle-hints", action="store_true",
                   help="ORACLE: set each request's retention hint from the trace's future (high when a later "
                        "request shares more than the first block with it, else low); an upper bound, not a policy")


def check_eviction_arguments(args: argparse.Namespace) -> None:
    """Before the run. Raises InvalidSpecError: reuse eviction or a hazard table with the unified
    layout, a hazard table with lru, a --save-hazard-table path that cannot be written
    (:func:`check_output_path`)."""
    from mambakv.core.errors import InvalidSpecError

    tables = args.hazard_table or args.save_hazard_table
    if args.layout == "unified" and (args.eviction == "reuse" or tables):
        raise InvalidSpecError("--eviction reuse and the hazard tables need --layout decoupled")
    if args.eviction == "lru" and tables:
        raise InvalidSpecError("the hazard tables need --eviction reuse")
    check_output_path(args.save_hazard_table, "--save-hazard-table")
