"""The reference scheduler's chunk-size policy: how many tokens a prefill step schedules.

Chunked prefill (Mamba block size B, the request's N known tokens, c computed)::

    stop  T = (N - 1) // B * B      (vLLM 0.33 too; older vLLM: N - N % B)  -- one chunk ends
                                    at T, so that a repeat of the prompt (hit capped at N - 1)
                                    finds a state there
    c < T:  chunk = largest multiple-of-B end <= min(c + budget, T), minus c;
            if that is 0, the unaligned remainder min(budget, N - c) (it publishes no state)
    c >= T: min(budget, N - c)
    junction J = ``coord.get_shared_prefix_length`` at admission: a chunk with c < J < c + chunk
            ends at J instead, so that the state at the end of a prefix shared with an earlier
            request is published and the next request sharing it hits (vLLM 0.33 does too)

B is the coordinator's hit alignment (the LCM of every group's block size) when a Mamba group
caches in an align mode, else 0: then a chunk is simply ``min(budget, N - c)``. Example, B = 16,
N = 100, budget 40: chunks end at 32, 64, 96 (T), 100. ``Scheduler.prefill_chunk`` calls
:func:`prefill_chunk` with the scheduler's alignment and stop rule.
"""

from __future__ import annotations

__all__ = ["prefill_chunk"]


def prefill_chunk(computed: int, num_tokens: int, budget: int, *, align: int,
                  stop_before_last_token: bool = True, junction: int = 0) -> int:
    """Tokens (> 0 when ``computed < num_tokens`` and ``budget > 0``) to schedule for a request
    with `computed` of `num_tokens` known tokens and `budget` tokens left in the step, by the
    rules of the module docstring: `align` is B (0: no alignment), `stop_before_last_token`
    picks ``T = (N - 1) // B * B`` (True) or ``N - N % B``, and a chunk that would run past
    `junction` (a multiple of B; 0: none) ends there."""
    B = align
    if not B:
        return min(budget, num_tokens - computed)
    stop = (num_tokens - 1) // B * B if stop_before_last_token else num_tokens - num_tokens % B
    n = min(budget, num_tokens - computed)
    if computed < stop:
        end = min(computed + budget, stop) // B * B
        if end > computed:
            n = end - computed
    if computed < junction < computed + n:
        return junction - computed
    return n
