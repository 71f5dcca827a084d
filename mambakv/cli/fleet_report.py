"""The text of ``mambakv fleet``: its ``--help`` epilog and its report (no heavy imports: the
command's parser is built from this module without loading the simulator)."""

from __future__ import annotations

from typing import Any

__all__ = ["FLEET_HELP", "format_fleet_report"]

#: The epilog of ``mambakv fleet --help``: what the report's numbers mean.
FLEET_HELP = """\
routers (each request at its arrival, to one instance's waiting queue):
  round-robin   request k -> instance k mod N
  least-loaded  the least load (tokens still owed: prompt + output - computed, over the
                requests waiting or running there); ties -> lowest index
  kv            the longest overlap of the prompt with the blocks the instance announced in
                its KV events (only blocks below a Mamba state checkpoint: what can be hit),
                among instances with load <= load bound x mean load; ties -> least load
  oracle        the longest hit each instance's coordinator gives, same bound and ties

report:
  hit rate      cached / prompt tokens over all instances (each request counted once, at its
                first admission); per instance the same over its own requests
  queue delay   arrival -> first admission, simulated ms (mean; p90 nearest rank)
  largest share the largest instance's share of all scheduled tokens (1/N is even)
  peak run / peak wait  most requests running / waiting on one instance at once
"""

def format_fleet_report(d: dict[str, Any]) -> str:
    """The text report of ``mambakv fleet`` (the JSON's main numbers and one row per instance)."""
    lines = [
        f"fleet: {d['instances']} x {d['memory_gib']:g} GiB, router {d['router']}"
        + (f" (load bound {d['load_bound']:g}x mean)" if d["router"] in ("kv", "oracle") else ""),
        f"requests      {d['requests']:,} ({d['finished']:,} finished, {d['rejected']:,} rejected)",
        f"hit rate      {d['hit_rate']:.4f}  ({d['cached_tokens']:,} of {d['prompt_tokens']:,} prompt tokens)",
        f"preemptions   {d['preemptions']:,}",
        f"queue delay   mean {d['queue_delay_ms_mean']:,.1f} ms, p90 {d['queue_delay_ms_p90']:,.1f} ms",
        f"largest share {d['max_scheduled_share']:.3f} of {d['scheduled_tokens']:,} scheduled tokens",
        f"sim clock     {d['sim_clock_ms'] / 1e3:,.1f} s (wall {d['wall_s']:.1f} s)",
        "",
        f"{'inst':>4} {'reqs':>6} {'hit rate':>8} {'preempt':>7} {'peak run':>8} {'peak wait':>9} "
        f"{'share':>6} {'delay ms':>9}",
    ]
    for p in d["per_instance"]:
        lines.append(f"{p['instance']:>4} {p['requests']:>6,} {p['hit_rate']:>8.4f} {p['preemptions']:>7,} "
                     f"{p['peak_running']:>8,} {p['peak_waiting']:>9,} {p['scheduled_share']:>6.3f} "
                     f"{p['queue_delay_ms_mean']:>9,.1f}")
    return "\n".join(lines)
