"""The text report of a ``mambakv`` run: one line of pool and settings, one table row per
KV-cache group, then the run's totals.  Its input is ``SimResult.to_dict()`` (the same object
``--json`` prints); REPORT_HELP explains every number and is the epilog of ``--help``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GIB", "MIB", "REPORT_HELP", "format_report"]

MIB = 1 << 20
GIB = 1 << 30

REPORT_HELP = """report: line 1 is the pool (blocks x bytes per block, memory; decoupled layout: superblocks
x bytes, each k attention pages or one state) and the settings; the table has
one row per KV-cache group: kind, layers, block size (tokens), the most blocks its tables held
at once (and MiB), and for Mamba groups the most blocks one request held (at most 2 + speculative
tokens + steps in flight); then the pool's peak (decoupled: where the budget is at the end, in
pages, states, the idle tails of state superblocks (fragmentation) and free superblocks, the mean
and peak state bytes, and how many superblocks changed pool), whether every block came back, requests
finished / rejected (a request of more prompt + output tokens than max_model_len, --max-model-len,
is rejected before the run), the
prefix hit rate (cached / prompt tokens, each request counted at its first admission), for a
trace the hit tokens by cause (shared first block / next turn / branch / repeat) and the tokens
whose KV was cached where no Mamba state was (state missing), preemptions, evictions, state copies,
for the decoupled layout the eviction units (a state and its pages) its policy evicted, those lost
by cascade, tail pages dropped past a chain's deepest state, leaf units reused, and ghost hits
(requests that passed an evicted unit, and the hit tokens it would have added), scheduler steps, the simulated time of the step clock
(--step-ms + --ms-per-token x scheduled tokens per step), wall time (building the cache included, and given apart) and the time spent inside
the library. --json prints the same numbers as one object."""


def format_report(d: dict[str, Any]) -> str:
    """The text report of a run (REPORT_HELP explains every number).

    `d` is ``SimResult.to_dict()`` of a run the command made (its settings included: model,
    memory_gib, max_num_batched_tokens, num_speculative_tokens, in_flight).
    """
    arena = d.get("arena")
    if arena is None:
        memory = f"{d['num_blocks']:,} blocks x {d['bytes_per_block'] / MIB:.2f} MiB"
    else:
        memory = (f"decoupled, {arena['superblocks']:,} superblocks x {arena['superblock_bytes'] / MIB:.2f} MiB "
                  f"({arena['pages_per_superblock']} pages of {d['page_tokens']} tokens = "
                  f"{arena['page_bytes'] / MIB:.2f} MiB, or one {arena['state_bytes'] / MIB:.2f} MiB state)")
    lines = [f"model {d['model']}: {memory} ({d['memory_gib']:g} GiB); budget {d['max_num_batched_tokens']} "
             f"tokens/step, {d['num_speculative_tokens']} speculative tokens, {d['in_flight']} steps in flight"]
    header = ("group", "kind", "layers", "block", "peak blocks", "peak MiB", "Mamba blocks/request")
    rows = [header]
    for i, g in enumerate(d["groups"]):
        per_req = g["peak_mamba_blocks_per_request"]
        rows.append((str(i), g["kind"], str(g["num_layers"]), str(g["block_size"]), f"{g['peak_blocks']:,}",
                     f"{g['peak_bytes'] / MIB:,.1f}", "-" if per_req is None else str(per_req)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if c == 1 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if arena is None:
        lines.append(f"pool peak {d['peak_blocks']:,} blocks ({d['peak_bytes'] / MIB:,.1f} MiB); "
                     f"all blocks returned: {'yes' if d['blocks_returned'] else 'NO'}")
    else:
        end = arena["final_bytes"]
        lines.append(f"budget at the end: pages {end['pages'] / GIB:,.2f} GiB, states {end['states'] / GIB:,.2f} GiB, "
                     f"idle in state superblocks {end['idle'] / GIB:,.2f} GiB (fragmentation), free "
                     f"{end['free'] / GIB:,.2f} GiB; states mean {arena['mean_state_bytes'] / GIB:,.2f} / peak "
                     f"{arena['peak_state_bytes'] / GIB:,.2f} GiB, fragmentation mean {arena['mean_idle_bytes'] / GIB:,.2f}"
                     f" GiB; {arena['conversions']:,} superblock conversions; all blocks returned: "
                     f"{'yes' if d['blocks_returned'] else 'NO'}")
    rejected = f", {d['rejected']:,} rejected" if d.get("rejected") else ""
    lines.append(f"requests {d['finished']:,}/{d['requests']:,} finished{rejected}; prompt {d['prompt_tokens']:,} tokens, "
                 f"cached {d['cached_tokens']:,}, hit rate {d['hit_rate']:.4f}; output {d['output_tokens']:,} tokens")
    if "hit_tokens_by_cause" in d:
        causes = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in d["hit_tokens_by_cause"].items())
        lines.append(f"replay {d['replay']} (skip {d['skip']:,}): hit tokens by cause: {causes}; "
                     f"state missing where attention hit: {d['state_missing_tokens']:,} tokens")
    lines.append(f"preemptions {d['preemptions']:,}; evictions {d['evictions']:,}; state copies {d['state_copies']:,}")
    ev = d.get("eviction")  # the decoupled layout's eviction units (absent unified)
    if isinstance(ev, dict):
        warm = " (warm-started hazard table)" if ev.get("warm_start") else ""
        lines.append(f"eviction {ev['policy']}{warm}: {ev['evictions']:,} units evicted, {ev['cascade_evictions']:,} by "
                     f"cascade; {ev['tail_pages']:,} tail pages dropped; {ev['reuses']:,} leaf reuses; ghost hits "
                     f"{ev['ghost_hits']:,} ({ev['ghost_hit_tokens']:,} tokens they would have added)")
    host = d.get("host")  # a host tier (--host-memory-gib)
    if isinstance(host, dict):
        lines.append(f"host tier {host['total_bytes'] / 2**30:,.1f} GiB ({host['write']}): hit rate gpu "
                     f"{d['hit_rate_gpu']:.4f} + host {d['hit_rate_host']:.4f}; {host['loads']:,} loads "
                     f"({d['bytes_h2d'] / 2**30:,.2f} GiB h2d, {host['load_ms'] / 1e3:,.2f} s), {host['stores']:,} stores "
                     f"({d['bytes_d2h'] / 2**30:,.2f} GiB d2h), {host['skipped_stores']:,} skipped")
    lines.append(f"steps {d['steps']:,}; simulated {d['sim_clock_ms'] / 1e3:,.2f} s; wall {d['wall_s']:.2f} s "
                 f"({d.get('build_s', 0.0):.2f} s building the cache), in the library {d['library_s'] * 1e3:,.1f} ms ({d['library_us_per_step']:.1f} us/step)")
    return "\n".join(lines)
