"""The run commands of ``mambakv``: ``replay``, ``trace`` and ``chat`` (their options and
``run_command``, which builds the coordinator and runs the workload through the reference
scheduler). ``sweep`` runs one ``trace`` per point through :func:`run_command`."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from mambakv.cli.args import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    PROBABILITY,
    Parser,
    add_eviction_arguments,
    add_host_arguments,
    add_max_model_len_argument,
    add_oracle_argument,
    check_eviction_arguments,
    host_arguments,
    progress,
    save_hazard_table,
    warn,
    warn_rejected,
)
from mambakv.cli.plot import check_plot_path, write_plot
from mambakv.cli.report import GIB, MIB, REPORT_HELP
from mambakv.models.kv_config import DEFAULT_PAGE_TOKENS, LAYOUTS

if TYPE_CHECKING:
    from mambakv.sim.runner import SimResult
    from mambakv.sim.workloads import RequestSpec

__all__ = ["PLAUSIBLE_SPECULATIVE_TOKENS", "add_run_commands", "run_command", "trace_parser"]

#: Above this many draft tokens per step ``--num-speculative-tokens`` gets a warning: MTP and
#: EAGLE drafters propose a handful of tokens per step; every draft costs each Mamba group one
#: more block per request, and the run is still allowed (the bound is a judgement, not a limit).
PLAUSIBLE_SPECULATIVE_TOKENS = 64


def _add_common(p: argparse.ArgumentParser, *, in_flight: int, spec_tokens: int) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="packaged model name (see `mambakv models`); "
                     "default qwen3-next-80b-a3b")
    src.add_argument("--config", default=None, metavar="CONFIG_JSON", help="a Hugging Face config.json")
    p.add_argument("--memory-gib", type=POSITIVE, default=60.0, help="KV-cache + state memory (GiB, default 60)")
    p.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, default=8192,
                   help="token budget per step (default 8192)")
    p.add_argument("--max-num-seqs", type=POSITIVE_INT, default=256, help="most running requests (default 256)")
    p.add_argument("--num-speculative-tokens", type=COUNT, default=spec_tokens,
                   help=f"draft tokens per decode step (default {spec_tokens})")
    p.add_argument("--acceptance-rate", type=PROBABILITY, default=0.7,
                   help="probability in [0, 1] that each next draft token is accepted, given the previous "
                        "one was (default 0.7)")
    p.add_argument("--in-flight", type=COUNT, default=in_flight,
                   help=f"async lag: steps whose results are not processed yet (default {in_flight})")
    p.add_argument("--use-eagle", action="store_true", help="EAGLE/MTP back-off of prefix hits")
    p.add_argument("--layout", choices=LAYOUTS, default="decoupled",
                   help="memory layout: decoupled (small attention pages and state slots on one byte budget; "
                        "default) or unified (vLLM 0.33's one page size, bit for bit)")
    p.add_argument("--page-tokens", type=POSITIVE_INT, default=DEFAULT_PAGE_TOKENS,
                   help=f"attention page of the decoupled layout, tokens (a multiple of 16; default {DEFAULT_PAGE_TOKENS})")
    p.add_argument("--placement", default=None, metavar="RULES",
                   help="checkpoint placement: comma-separated rules where prefill chunks end (so where Mamba "
                        "states are published): replay_boundary, junction, chunk_ends, chunk_grid:K; default "
                        "chunk_ends,replay_boundary,junction (vLLM 0.33's)")
    p.add_argument("--decode-checkpoints", choices=("none", "every", "latest"), default=None,
                   help="decode-boundary states of the Mamba groups: every (eager align, a block per boundary; "
                        "the unified default), none (no decode-boundary state; the decoupled default), latest (running state in place, a spare near a boundary only if free without "
                        "eviction, published once settled)")
    p.add_argument("--mamba-policy", choices=("eager", "lazy", "lazy-evict"), default=None,
                   help="alias (0.x): eager = --decode-checkpoints every, lazy = latest, lazy-evict = latest with "
                        "spares that may evict a cached block (a benchmark knob)")
    p.add_argument("--step-ms", type=NON_NEGATIVE, default=10.0, help="step clock: fixed ms per step (default 10)")
    p.add_argument("--ms-per-token", type=NON_NEGATIVE, default=0.05,
                   help="step clock: ms per scheduled token (default 0.05)")
    p.add_argument("--seed", type=COUNT, default=0,
                   help="seed of the random prompts, outputs and draft acceptance (default 0)")
    add_eviction_arguments(p)
    add_host_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="write a chart of blocks in use per group against the pool's capacity and the running "
                        "hit rate, per step (.png, .svg or .pdf; needs matplotlib); checked before the run")



def add_run_commands(sub: Any) -> None:
    """The ``replay``, ``trace`` and ``chat`` subcommands on `sub` (an argparse subparsers object)."""
    epilog, raw = REPORT_HELP, argparse.RawDescriptionHelpFormatter  # the run commands explain their report
    p = sub.add_parser("replay", help="one long prefill (default 480,031 tokens): Mamba blocks per request",
                       epilog=epilog, formatter_class=raw)
    _add_common(p, in_flight=2, spec_tokens=5)
    p.add_argument("--prompt-tokens", type=POSITIVE_INT, default=480_031, help="prompt length (default 480031)")
    p.add_argument("--output-tokens", type=POSITIVE_INT, default=4, help="tokens to generate (default 4)")
    p = sub.add_parser("trace", help="a Mooncake JSONL trace: hit rate, peaks, preemptions, time",
                       epilog=epilog, formatter_class=raw)
    p.add_argument("path", help="Mooncake trace file: one JSON object per line (timestamp in ms, input_length, "
                                "output_length >= 1, hash_ids), in arrival order: a timestamp below the previous "
                                "line's is an error naming the line (sort the file by timestamp first)")
    _add_common(p, in_flight=0, spec_tokens=0)
    add_max_model_len_argument(p)
    p.add_argument("--limit", type=POSITIVE_INT, default=None, help="first N requests (default: all)")
    p.add_argument("--one-at-a-time", action="store_true", help="each request alone, in arrival order")
    p.add_argument("--max-output-tokens", type=POSITIVE_INT, default=None,
                   help="cap each request's output length (default: the trace's)")
    p.add_argument("--skip", type=COUNT, default=0, metavar="N", help="start at line N+1 of the trace (default 0)")
    p.add_argument("--replay", choices=("strict", "conversation"), default="strict",
                   help="strict (default): equal hash ids = equal tokens, outputs unique; conversation: as strict, "
                        "and a next turn that is long enough begins with its parent's prompt and generated tokens")
    add_oracle_argument(p)
    p = sub.add_parser("chat", help="multi-turn conversations (each turn extends the previous one)",
                       epilog=epilog, formatter_class=raw)
    _add_common(p, in_flight=0, spec_tokens=0)
    p.add_argument("--conversations", type=POSITIVE_INT, default=8, help="number of chats (default 8)")
    p.add_argument("--turns", type=POSITIVE_INT, default=4, help="turns per chat (default 4)")
    p.add_argument("--one-at-a-time", action="store_true", help="each turn alone, in arrival order")


def trace_parser() -> argparse.ArgumentParser:
    """A parser of ``mambakv trace``'s arguments alone (``trace PATH [options]``), as the
    command has them: what ``sweep`` checks and runs its points with."""
    parser = Parser(prog="mambakv")
    add_run_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def _blocks_needed(model: str, tokens: int, args: argparse.Namespace) -> tuple[int, int] | None:
    """``(blocks, bytes per block)`` a pool needs to run one request of `tokens` tokens alone
    (every decode-checkpoint policy: latest and none never pin more than every).

    ``1 (null) + attention groups x ceil((tokens + K) / block) + Mamba groups x (2 + K)`` with K
    speculative tokens: the request's KV blocks, plus a running and a checkpoint state and K
    draft states per Mamba group (steps in flight wait instead of needing more).  Measured
    against the scheduler on Qwen3-Next (block 544, 1 + 3 groups): the 480,035-token replay runs
    in 905 blocks and not in 904 (K = 5, 2 in flight), in 890 and not 889 with K = 0 and none
    in flight. Decoupled: ``cdiv(1 + attention groups x ceil((tokens + K) / page), k)`` page
    superblocks plus one superblock per state slot.
    """
    from mambakv.models import load_model, plan_pages
    from mambakv.models.kv_config import plan_superblocks

    plan = plan_pages(load_model(model))
    k = args.num_speculative_tokens
    if args.layout == "decoupled" and plan.attention_groups:
        # superblocks: the pages (null page included) in whole superblocks, one per state slot
        geo = plan_superblocks(load_model(model), 1 << 62, page_tokens=args.page_tokens)
        pages = 1 + len(plan.attention_groups) * -(-(tokens + k) // args.page_tokens)
        return (-(-pages // geo.pages_per_superblock) + len(plan.mamba_groups) * (2 + k)), geo.superblock_bytes
    blocks = (1 + len(plan.attention_groups) * -(-(tokens + k) // plan.block_size)
              + len(plan.mamba_groups) * (2 + k))
    return blocks, plan.bytes_per_block


def _mamba_policy(args: argparse.Namespace) -> str | None:
    """``--decode-checkpoints``, or the ``--mamba-policy`` alias (eager -> every, lazy -> latest,
    lazy-evict -> latest-evict); both given must agree. None: the layout's default."""
    alias = {"eager": "every", "lazy": "latest", "lazy-evict": "latest-evict"}.get(args.mamba_policy or "")
    chosen = args.decode_checkpoints
    if alias is not None and chosen is not None and alias.split("-")[0] != chosen:
        raise SystemExit(f"mambakv: error: --mamba-policy {args.mamba_policy} means --decode-checkpoints "
                         f"{alias.split('-')[0]}, not {chosen}")
    return alias or chosen


# --------------------------------------------------------------------------- commands
def run_command(args: argparse.Namespace) -> dict[str, Any]:
    """Run a parsed ``replay``, ``trace`` or ``chat`` command; its ``--json`` object (``sweep``
    runs one ``trace`` per point through it)."""
    from mambakv.models import load_model
    from mambakv.sim import DEFAULT_MODEL, conversations, load_trace, run_conversations, run_replay, run_trace
    from mambakv.sim.runner import DEFAULT_MAX_MODEL_LEN, model_max_len
    from mambakv.sim.sim_request import BudgetTooSmallError

    check_plot_path(args.plot)
    if args.num_speculative_tokens > PLAUSIBLE_SPECULATIVE_TOKENS:
        warn(f"--num-speculative-tokens {args.num_speculative_tokens} is implausibly large: MTP / EAGLE drafters "
             f"propose a few tokens per step (usually 1-5), and each draft costs every Mamba group one more "
             f"block per request ({2 + args.num_speculative_tokens} each here)")
    model = args.config or args.model or DEFAULT_MODEL
    load_model(model)  # an unknown name or a bad config.json: refused before any work
    # trace: --max-model-len, else the model's own context length; replay and chat: the default
    max_len = (args.max_model_len or model_max_len(model)) if args.command == "trace" else DEFAULT_MAX_MODEL_LEN
    common = dict(max_num_batched_tokens=args.max_num_batched_tokens, num_speculative_tokens=args.num_speculative_tokens,
                  in_flight=args.in_flight, memory_gib=args.memory_gib, use_eagle=args.use_eagle, seed=args.seed,
                  acceptance_rate=args.acceptance_rate, step_ms=args.step_ms, ms_per_token=args.ms_per_token,
                  mamba_policy=_mamba_policy(args), layout=args.layout, page_tokens=args.page_tokens,
                  placement=args.placement.split(",") if args.placement else None,
                  eviction=args.eviction, hazard_table=args.hazard_table, **host_arguments(args))
    check_eviction_arguments(args)
    bar = None
    specs: list[RequestSpec] | None = None
    result: SimResult
    try:
        if args.command == "replay":
            result = run_replay(model, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                max_num_seqs=args.max_num_seqs, **common)
        else:
            if args.command == "trace":
                specs = load_trace(args.path, limit=args.limit, max_output_tokens=args.max_output_tokens,
                                   skip=args.skip)
            else:
                specs = conversations(args.conversations, args.turns, seed=args.seed)
            bar = progress(len(specs), args.quiet)
            on_finish = (lambda _r: bar.update(1)) if bar is not None else None
            if args.command == "trace":
                result = run_trace(args.path, model, specs=specs, limit=args.limit, max_num_seqs=args.max_num_seqs,
                                   one_at_a_time=args.one_at_a_time, on_finish=on_finish, replay=args.replay,
                                   skip=args.skip, oracle_hints=args.oracle_hints, max_model_len=max_len, **common)
            else:
                result = run_conversations(model, num_conversations=args.conversations, turns=args.turns, specs=specs,
                                           max_num_seqs=args.max_num_seqs, one_at_a_time=args.one_at_a_time,
                                           on_finish=on_finish, **common)
    except BudgetTooSmallError as e:
        # the longest request that runs (longer ones are rejected before the run)
        lengths = ([args.prompt_tokens + args.output_tokens] if specs is None else
                   [n for s in specs if (n := s.num_prompt_tokens + s.output_len) <= max_len])
        longest = max(lengths, default=0)
        need = _blocks_needed(model, longest, args) if longest else None
        if need is None:
            raise
        blocks, per_block = need
        gib = math.ceil(blocks * per_block / GIB * 100) / 100
        unit = "superblocks" if args.layout == "decoupled" else "blocks"
        raise BudgetTooSmallError(f"{e}; the longest request ({longest:,} tokens) needs about {blocks:,} {unit} "
                                  f"of {per_block / MIB:.2f} MiB: --memory-gib {gib:.2f} or more") from None
    finally:
        if bar is not None:
            bar.close()
    if args.save_hazard_table:
        save_hazard_table(result.coord, args.save_hazard_table)
    d = result.to_dict()
    if d["rejected"]:
        warn_rejected(d["rejected"], d["requests"], d["max_model_len"])
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return d
