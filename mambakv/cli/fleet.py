"""``mambakv fleet``: its arguments and its run (the fleet itself is :mod:`mambakv.sim.fleet`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from mambakv.cli.args import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    add_max_model_len_argument,
    number,
    progress,
    warn_rejected,
)
from mambakv.cli.plot import check_plot_path
from mambakv.models.kv_config import LAYOUTS

if TYPE_CHECKING:

    pass

__all__ = ["FLEET_INDEXES", "FLEET_LOAD_BOUND", "FLEET_ROUTERS", "add_fleet_arguments", "run_fleet_command"]

#: ``mambakv fleet`` choices (``mambakv.sim.router.ROUTERS``, ``mambakv.sim.fleet.INDEXES`` and
#: ``DEFAULT_LOAD_BOUND``; literal here so that building the parser loads no simulator).
FLEET_ROUTERS = ("round-robin", "least-loaded", "kv", "oracle")
FLEET_INDEXES = ("mambakv", "dynamo")
FLEET_LOAD_BOUND = 1.5


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="Mooncake trace file, as for `mambakv trace` (in arrival order)")
    p.add_argument("--instances", type=POSITIVE_INT, default=4, help="engines in the fleet (default 4)")
    p.add_argument("--router", choices=FLEET_ROUTERS, default="round-robin",
                   help="routing policy (default round-robin)")
    p.add_argument("--load-bound", type=number(float, low=1, low_ok=True), default=FLEET_LOAD_BOUND,
                   help="kv / oracle: only instances with load <= this x the mean load (default 1.5)")
    p.add_argument("--index", choices=FLEET_INDEXES, default="mambakv",
                   help="kv: mambakv's own index, or Dynamo's RadixTree (needs ai-dynamo-runtime)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="packaged model name; default qwen3-next-80b-a3b")
    src.add_argument("--config", default=None, metavar="CONFIG_JSON", help="a Hugging Face config.json")
    p.add_argument("--memory-gib", type=POSITIVE, default=60.0, help="memory per instance (GiB, default 60)")
    p.add_argument("--layout", choices=LAYOUTS, default="decoupled", help="as for `mambakv trace` (default decoupled)")
    p.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, default=8192, help="per step (default 8192)")
    p.add_argument("--max-num-seqs", type=POSITIVE_INT, default=256, help="most running requests (default 256)")
    p.add_argument("--limit", type=POSITIVE_INT, default=None, help="first N requests (default: all)")
    p.add_argument("--skip", type=COUNT, default=0, metavar="N", help="start at line N+1 of the trace (default 0)")
    p.add_argument("--replay", choices=("strict", "conversation"), default="strict", help="as for `mambakv trace`")
    add_max_model_len_argument(p)
    p.add_argument("--step-ms", type=NON_NEGATIVE, default=10.0, help="step clock: fixed ms per step (default 10)")
    p.add_argument("--ms-per-token", type=NON_NEGATIVE, default=0.05, help="step clock: ms per token (default 0.05)")
    p.add_argument("--seed", type=COUNT, default=0, help="seed of the outputs (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="bars per instance: share of scheduled tokens and hit rate (.png, .svg or .pdf)")


def run_fleet_command(args: argparse.Namespace) -> str:
    from mambakv.cli.fleet_report import format_fleet_report
    from mambakv.cli.plot import write_fleet_plot
    from mambakv.sim import DEFAULT_MODEL, load_trace
    from mambakv.sim.fleet import run_fleet
    from mambakv.sim.runner import model_max_len

    check_plot_path(args.plot)
    model = args.config or args.model or DEFAULT_MODEL
    max_len = args.max_model_len or model_max_len(model)  # loads the config: a bad one is refused here
    specs = load_trace(args.path, limit=args.limit, skip=args.skip)
    bar = progress(len(specs), args.quiet)
    try:
        result = run_fleet(args.path, model, instances=args.instances, router=args.router, load_bound=args.load_bound,
                           index=args.index, memory_gib=args.memory_gib, limit=args.limit, skip=args.skip,
                           replay=args.replay, max_num_seqs=args.max_num_seqs, specs=specs, layout=args.layout,
                           max_model_len=max_len, max_num_batched_tokens=args.max_num_batched_tokens,
                           step_ms=args.step_ms, ms_per_token=args.ms_per_token, seed=args.seed,
                           on_finish=(lambda _r: bar.update(1)) if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    d = result.to_dict()
    if d["rejected"]:
        warn_rejected(d["rejected"], d["requests"], max_len)
    if args.plot:
        write_fleet_plot(d, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return json.dumps(d, indent=1) if args.json else format_fleet_report(d)
