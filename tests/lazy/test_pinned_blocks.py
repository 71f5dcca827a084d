"""Blocks pinned per running request, decode_checkpoints every vs latest, nspec 0 and 3
(issue 16's hard requirement: latest never pins more than every).

One request (block 64, 500-token prompt: chunks end at 448 and 500), every verify accepts 0
drafts, so decode advances one token per step: the step from c computes c + 1 .. c + 1 + K.
After each allocate, count the request's non-null table blocks (the pool blocks it pins).
Outside a window: the step from 600 (next boundary 640). Inside: the most over 620 .. 660.

    policy  K  outside  inside  why (inside)
    every   0  1        2       running, + the last state at the step whose slot moves
    every   3  4        5       running + 3 scratch, + the last state at the crossing
    latest  0  1        2       running, + the spare while a step may reach 640
    latest  3  4        5       running + 3 scratch, + the spare
"""

from __future__ import annotations

import pytest

from mambakv import Request
from tests.coord_helpers import coordinator, tokens
from tests.helpers import mamba_spec


def test_spec_bound():
    assert mamba_spec(64, 3).blocks_per_running_request == 2 + 3
    assert mamba_spec(64, 3, decode_checkpoints="latest").blocks_per_running_request == 5
    assert mamba_spec(64, 0, mode="lazy").blocks_per_running_request == 2  # the 0.x name: latest


def drive_decode(mode: str, nspec: int, lag: int) -> tuple[int, int, list[int]]:
    """decode_checkpoints `mode` (every / latest), async lag 0 or 1: the same request, every
    verify accepts 0 drafts. Returns (pinned at the step from 600, most pinned over the steps
    from 620 .. 660, pinned per step from 630 .. 650)."""
    coord = coordinator(64, mamba_spec(64, nspec, decode_checkpoints=mode), max_model_len=1024)
    m = coord.managers[0]
    req = Request("r", tokens(500))
    for n in (448, 52):
        if req.num_computed_tokens:
            coord.retire("r", req.num_computed_tokens)
        assert coord.allocate(req, n) is not None
        req.num_computed_tokens += n
    req.append_output_token_ids(1)
    coord.retire("r", 500)
    in_flight: list[int] = []  # starts of planned steps whose results are not processed
    settled, outside, inside, per_step = 500, 0, 0, []
    for _ in range(500, 700):
        start = req.num_computed_tokens
        assert coord.allocate(req, 1 + nspec, num_draft_tokens=nspec) is not None
        req.num_computed_tokens += 1 + nspec  # optimistic under async
        coord.take_copy_plan(), coord.take_zero_plan(), coord.take_checkpoint_writes()
        in_flight.append(start)
        held = m.num_held_blocks("r")
        if settled == 600:
            outside = held
        if 620 <= settled <= 660:
            inside = max(inside, held)
        if 630 <= settled <= 650:
            per_step.append(held)
        while len(in_flight) > lag:
            in_flight.pop(0)
            coord.accept_drafts("r", 0)
            req.num_computed_tokens -= nspec
            settled += 1
            req.append_output_token_ids(1)
            coord.retire("r", settled)
        coord.check_invariants()
    coord.free("r")
    assert coord.block_pool.get_num_free_blocks() == 63
    return outside, inside, per_step


@pytest.mark.parametrize("nspec", [0, 3])
@pytest.mark.parametrize("lag", [0, 1])
def test_latest_never_pins_more_than_every(nspec, lag):
    """Issue 16's hard requirement. Outside a window both hold running + scratch (1 + nspec);
    inside, every holds the last state at the crossing step and latest holds the spare
    (2 + nspec at most, each). Per step (settled 630 .. 650) latest holds its 2 + nspec for
    longer: nspec 3, sync 4 steps against every's 1; lag 1: 8 against 5 (nspec 0: 1 against
    1, lag 1: 2 against 2) - the spare is taken as soon as a step can reach the boundary."""
    every = drive_decode("every", nspec, lag)
    latest = drive_decode("latest", nspec, lag)
    assert every[0] == latest[0] == 1 + nspec
    assert latest[1] <= every[1] == 2 + nspec
    assert latest[1] == 2 + nspec
