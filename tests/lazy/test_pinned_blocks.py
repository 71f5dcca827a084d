"""Blocks pinned per running request, eager ALIGN vs ALIGN_LAZY, nspec 0 and 3 (issue 10).

One request (block 64, 500-token prompt: chunks end at 448 and 500), synchronous
scheduling, every verify accepts 0 drafts, so decode advances one token per step: the step
from c computes c + 1 .. c + 1 + K. After each allocate, count the request's non-null table
blocks (prefix-cache blocks it pins) and the scratch rows it borrows.

Outside the window: the step from c = 600 (next boundary 640, 640 - 600 > 2 (K + 1)).
Inside: the most over the steps c = 620 .. 660 (around the boundary 640).

    mode   K  outside  inside  why (inside)
    eager  0  1        2       running, + the last state at the step whose slot moves (641)
    eager  3  4        5       running + 3 scratch, + the last state from the step 637 (641)
    lazy   0  2        3       W + C, + the spare S while 640 - p <= 2
    lazy   3  2        3       W + C, + S while 640 - p <= 8; scratch rows: 3, lent
"""

from __future__ import annotations

import pytest

from mambakv import Request
from tests.coord_helpers import coordinator, tokens
from tests.helpers import mamba_spec


def drive(mode: str, nspec: int) -> tuple[int, int, int, int]:
    """Returns (pinned outside, most pinned inside, scratch rows lent, blocks reserved)."""
    coord = coordinator(64, mamba_spec(64, nspec, mode=mode), max_model_len=1024, max_num_seqs=4)
    m = coord.managers[0]
    req = Request("r", tokens(500))
    for n in (448, 52):  # prefill, retire to the computed tokens before each later chunk
        if req.num_computed_tokens:
            coord.retire("r", req.num_computed_tokens)
        assert coord.allocate(req, n) is not None
        req.num_computed_tokens += n
    req.append_output_token_ids(1)
    coord.retire("r", 500)
    outside, inside = None, 0
    for c in range(500, 700):
        assert coord.allocate(req, 1 + nspec) is not None  # 1 real token + nspec drafts
        req.num_computed_tokens += 1 + nspec
        coord.take_copy_plan(), coord.take_zero_plan(), coord.take_checkpoint_writes()
        held = m.num_held_blocks("r")
        if c == 600:
            outside = held
        if 620 <= c <= 660:
            inside = max(inside, held)
        plan = coord.get_state_plan("r").get(0)
        lent = len(plan.scratch_block_ids) if plan else nspec
        coord.accept_drafts("r", 0)
        req.num_computed_tokens -= nspec
        req.append_output_token_ids(1)
        coord.retire("r", c + 1)
        coord.check_invariants()
    reserved = coord.block_pool.num_reserved_blocks
    coord.free("r")
    coord.check_invariants()
    assert coord.block_pool.get_num_free_blocks() == 63 - reserved  # nothing leaked
    return outside, inside, lent, reserved


@pytest.mark.parametrize("mode,nspec,expected", [
    ("align", 0, (1, 2, 0, 0)),
    ("align", 3, (4, 5, 3, 0)),        # eager's scratch is in the table (lent = the table's 3)
    ("align_lazy", 0, (2, 3, 0, 0)),
    ("align_lazy", 3, (2, 3, 3, 12)),  # max_num_seqs 4 x 3 rows reserved once, for the group
])
def test_pinned_blocks_per_running_request(mode, nspec, expected):
    assert drive(mode, nspec) == expected


def test_spec_bound():
    assert mamba_spec(64, 3, mode="align_lazy").blocks_per_running_request == 2 + 3
    assert mamba_spec(64, 3, mode="lazy").blocks_per_running_request == 5
    assert mamba_spec(64, 0, mode="align_lazy").blocks_per_running_request == 2


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
