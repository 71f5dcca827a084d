"""Workloads for the reference scheduler: one long prefill, a Mooncake trace, multi-turn chats.

A workload is a list of :class:`RequestSpec` in arrival order.  Prompts are built lazily
(``spec.prompt()``) so that a 12,000-request trace does not hold every prompt in memory.

Mooncake trace format (``../shared/traces/README.md``): one JSON object per line with
``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (ids of the prompt's
512-token blocks).  Block j of a prompt is 512 token ids drawn from a numpy PCG64 generator
seeded by ``hash_ids[j]`` (``np.random.default_rng(hash_id)``), truncated to ``input_length``:
equal ids give equal tokens, so prefix sharing is exactly the trace's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mambakv.core.errors import TraceFormatError

__all__ = ["DEFAULT_VOCAB", "MAX_TIMESTAMP_MS", "TRACE_BLOCK_TOKENS", "RequestSpec", "conversations", "load_trace",
           "fixed_prompt", "long_prefill", "trace_block_tokens"]

#: Qwen3-Next's vocabulary size (``vocab_size`` in its config.json).
DEFAULT_VOCAB = 151_936
#: Tokens per hash id in the Mooncake trace.
TRACE_BLOCK_TOKENS = 512
#: Latest ``timestamp`` a trace line may carry (ms): 10**12 ms is ~31.7 years from the start of
#: the trace; anything later is a unit mistake (ns, or an epoch in us), not an arrival time.
MAX_TIMESTAMP_MS = 10**12
#: Most prompt tokens :func:`conversations` may build (it holds every prompt: 2**28 int32 ids
#: are 1 GiB), bounded with the longest message and output lengths.
MAX_CHAT_TOKENS = 1 << 28


@dataclass
class RequestSpec:
    """One request of a workload.

    Attributes:
        request_id: unique in the workload.
        arrival_ms: arrival time on the step clock (ms from the start).
        num_prompt_tokens: prompt length (tokens).
        output_len: tokens to generate (>= 1; the request finishes when it has them).
        make_prompt: builds the prompt ids (int32 array of ``num_prompt_tokens``).
        output_token_ids: the ids to "generate" (multi-turn chats reuse them in the next
            turn); None draws random ids from the scheduler's seeded generator.
        retain: the request's retention hint (``Request.retain``; ``mambakv trace
            --oracle-hints`` sets it from the trace's future).
    """

    request_id: str
    arrival_ms: float
    num_prompt_tokens: int
    output_len: int
    make_prompt: Callable[[], np.ndarray] = field(repr=False)
    output_token_ids: np.ndarray | None = field(default=None, repr=False)
    retain: str | float | None = None

    def prompt(self) -> np.ndarray:
        return self.make_prompt()


def fixed_prompt(ids: np.ndarray) -> Callable[[], np.ndarray]:
    """A ``make_prompt`` that returns `ids` (a prompt already built, e.g. a chat turn's)."""
    return lambda: ids


def long_prefill(num_tokens: int = 480_031, *, output_len: int = 1, vocab: int = DEFAULT_VOCAB,
                 seed: int = 0) -> list[RequestSpec]:
    """One request of `num_tokens` random prompt tokens arriving at 0 ms (the 480k replay)."""
    if num_tokens <= 0 or output_len <= 0:
        raise TraceFormatError(f"need num_tokens > 0 and output_len > 0, got {num_tokens}, {output_len}")

    def make() -> np.ndarray:
        return np.random.default_rng(seed).integers(0, vocab, num_tokens, dtype=np.int32)

    return [RequestSpec("prefill-0", 0.0, num_tokens, output_len, make)]


class _BlockTokens:
    """Token ids of trace blocks by hash id, with a bounded memo (conversations repeat ids)."""

    def __init__(self, vocab: int, max_entries: int = 16_384) -> None:
        self.vocab = vocab
        self.max_entries = max_entries
        self._memo: dict[int, np.ndarray] = {}

    def __call__(self, hash_id: int) -> np.ndarray:
        toks = self._memo.get(hash_id)
        if toks is None:
            toks = trace_block_tokens(hash_id, self.vocab)
            if len(self._memo) >= self.max_entries:
                self._memo.clear()
            self._memo[hash_id] = toks
        return toks


def trace_block_tokens(hash_id: int, vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """The 512 token ids of trace block `hash_id` (int32, each in ``[0, vocab)``)."""
    return np.random.default_rng(hash_id).integers(0, vocab, TRACE_BLOCK_TOKENS, dtype=np.int32)


def _trace_row(path: Path, lineno: int, raw: bytes) -> tuple[float, int, int, list[int]] | None:
    """One parsed line: ``(timestamp ms, input_length, output_length, hash_ids)``, or None for a
    blank line.  Raises TraceFormatError naming `path` and `lineno`."""
    def bad(why: str) -> TraceFormatError:
        return TraceFormatError(f"{path}: line {lineno}: {why}")

    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise bad(f"not valid JSON ({e.msg})") from None
    except ValueError as e:  # not a JSON syntax error: an integer beyond Python's digit limit
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise bad("expected a JSON object")
    try:
        ts, n_in, n_out, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
    except KeyError as e:
        raise bad(f"missing field {e.args[0]!r}") from None
    # compared before any float conversion: an int of 400 digits is refused, not an OverflowError
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not 0 <= ts <= MAX_TIMESTAMP_MS:
        shown = repr(ts) if len(repr(ts)) <= 40 else f"{repr(ts)[:20]}... ({len(repr(ts))} characters)"
        raise bad(f"timestamp must be a finite number of ms in [0, 10^12], got {shown}")
    for name, v, low in (("input_length", n_in, 1), ("output_length", n_out, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise bad(f"{name} must be an int >= {low}, got {v!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                            for h in ids):
        raise bad("hash_ids must be a list of non-negative ints")
    if len(ids) * TRACE_BLOCK_TOKENS < n_in:
        raise bad(f"{len(ids)} hash_ids cover {len(ids) * TRACE_BLOCK_TOKENS} tokens < input_length {n_in}")
    return float(ts), n_in, n_out, ids


def iter_trace_rows(path: str | Path, *, skip: int = 0, limit: int | None = None,
                    ) -> Iterator[tuple[float, int, int, list[int]]]:
    """The parsed request lines of a Mooncake trace, ``(timestamp ms, input_length,
    output_length, hash_ids)``, from line ``skip + 1``, at most `limit` of them, blank lines
    skipped: the one reader of :func:`load_trace` and the conversation replay.  Timestamps
    must not decrease from one request line to the next (the lines read, from ``skip + 1``).

    Raises:
        TraceFormatError: as :func:`load_trace`.
    """
    p = Path(path)
    if limit is not None and limit <= 0:
        raise TraceFormatError(f"limit must be > 0, got {limit}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise TraceFormatError(f"skip must be an int >= 0, got {skip!r}")
    try:
        f = p.open("rb")  # bytes: a non-UTF-8 line is reported with its number
    except OSError as e:
        raise TraceFormatError(f"cannot read trace {p}: {e.strerror or e}") from None
    count = 0
    prev: tuple[int, float] | None = None  # (line, timestamp) of the previous request line
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and count >= limit:
                break
            if lineno <= skip:
                continue
            row = _trace_row(p, lineno, line)
            if row is not None:
                if prev is not None and row[0] < prev[1]:
                    raise TraceFormatError(f"{p}: line {lineno}: timestamp {row[0]:g} is before line {prev[0]}'s "
                                           f"{prev[1]:g}; a trace is in arrival order (sort it by timestamp)")
                prev = (lineno, row[0])
                count += 1
                yield row


def load_trace(path: str | Path, *, limit: int | None = None, vocab: int = DEFAULT_VOCAB,
               max_output_tokens: int | None = None, skip: int = 0) -> list[RequestSpec]:
    """The first `limit` requests (all when None) of a Mooncake JSONL trace, starting at line
    ``skip + 1`` (the first `skip` lines are not read as requests; ids are ``trace-{skip + k}``).

    ``output_len = output_length``, capped at `max_output_tokens` when given. Blank lines are
    skipped.  Requests are returned in file order, which must be arrival order.  A request
    longer than the model allows is not an error here: the run rejects it (``run_workload``).

    Raises:
        TraceFormatError: the file cannot be read, or a line is malformed: not UTF-8, not a
            JSON object, a missing field, a timestamp that is not a number of ms in
            ``[0, MAX_TIMESTAMP_MS]`` (JSON ``NaN`` / ``Infinity`` are refused), a timestamp
            below the previous request line's, an ``input_length`` or ``output_length`` that is
            not an int >= 1, bad hash ids (the message names the file and the 1-based line
            number); `limit` <= 0, `skip` < 0, or no request after line `skip`.
    """
    p = Path(path)
    tokens = _BlockTokens(vocab)
    out: list[RequestSpec] = []
    for row in iter_trace_rows(p, skip=skip, limit=limit):
        ts, n_in, n_out, ids = row
        if max_output_tokens is not None:
            n_out = min(n_out, max(1, max_output_tokens))

        def make(ids: list[int] = ids, n: int = n_in) -> np.ndarray:
            k = -(-n // TRACE_BLOCK_TOKENS)
            return np.concatenate([tokens(h) for h in ids[:k]])[:n]

        out.append(RequestSpec(f"trace-{skip + len(out)}", ts, n_in, n_out, make))
    if not out:
        raise TraceFormatError(f"{p}: no requests" + (f" after line {skip}" if skip else ""))
    return out


def conversations(num_conversations: int = 8, turns: int = 4, *, seed: int = 0, vocab: int = DEFAULT_VOCAB,
                  system_tokens: int = 1024, message_tokens: tuple[int, int] = (64, 1024),
                  output_tokens: tuple[int, int] = (16, 256), think_ms: float = 2000.0,
                  spacing_ms: float = 100.0) -> list[RequestSpec]:
    """Multi-turn chats: turn t+1's prompt = turn t's prompt + its output + a new message.

    Every chat starts with the same `system_tokens`-token system prompt (shared by all), then a
    message; lengths are drawn uniformly from the given ``(low, high)`` ranges with `seed`.
    Chat c starts at ``c * spacing_ms``; turn t arrives ``t * think_ms`` later.  The output ids
    are fixed by the workload (``output_token_ids``) so that the next turn really contains them.
    Returned sorted by arrival time.

    Raises:
        TraceFormatError: a count <= 0, or more than MAX_CHAT_TOKENS prompt tokens in the worst
            case.
    """
    if num_conversations <= 0 or turns <= 0:
        raise TraceFormatError(f"need conversations > 0 and turns > 0, got {num_conversations}, {turns}")
    # turn t's prompt <= system + (t + 1) x message + t x output; summed over t < turns
    msg, out_max = message_tokens[1], output_tokens[1]
    worst = num_conversations * (turns * system_tokens + msg * turns * (turns + 1) // 2
                                 + out_max * turns * (turns - 1) // 2)
    if worst > MAX_CHAT_TOKENS:
        raise TraceFormatError(f"{num_conversations} conversations x {turns} turns may hold {worst:,} prompt "
                               f"tokens > {MAX_CHAT_TOKENS:,}; use fewer")
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    system = nprng.integers(0, vocab, system_tokens, dtype=np.int32)
    out: list[RequestSpec] = []
    for c in range(num_conversations):
        history = system
        for t in range(turns):
            message = nprng.integers(0, vocab, rng.randint(*message_tokens), dtype=np.int32)
            prompt = np.concatenate([history, message])
            reply = nprng.integers(0, vocab, rng.randint(*output_tokens), dtype=np.int32)
            out.append(RequestSpec(f"chat-{c}-{t}", c * spacing_ms + t * think_ms, int(prompt.size),
                                   int(reply.size), fixed_prompt(prompt), reply))
            history = np.concatenate([prompt, reply])
    out.sort(key=lambda s: s.arrival_ms)
    return out
