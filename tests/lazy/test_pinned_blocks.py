"""Blocks pinned per running request, decode_checkpoints every vs latest, nspec 0 and 3,
synchronous and async lag 1, at every step (issue 16's hard requirement: latest never pins
more than every), counted through the public API (``coordinator.describe``).

One request (block 64, 500-token prompt: chunks end at 448 and 500), decode steps of
``1 + nspec`` tokens (nspec drafts), every verify accepts 0 unless a script says otherwise.
After each ``allocate``, count the non-null block ids of the request's table. Worked by hand
with the rules of mambakv/groups/decode_checkpoints.py, B = 640, "settled" = the request's settled
count when the step is planned (lag 1: the previous step is still in flight)::

    settled           630 .. 632  633  634  635  636  637  638  639  640  641 ..
    K 0  sync  every    1 ..  1    1    1    1    1    1    1    1    2    1      step 640 grows: + 640's block
               latest   1 ..  1    1    1    1    1    1    1    1    2    1      the same (tagged, as every)
    K 0  lag 1 every    1 ..  1    1    1    1    1    1    1    2    2    1
               latest   1 ..  1    1    1    1    1    1    1    2    2    1
    K 3  sync  every    4 ..  4    4    4    4    4    5    4    4    4    4      step 637 grows (641 > 640)
               latest   4 ..  4    4    4    4    4    4    4    4    4    4      advances in place
    K 3  lag 1 every    4 ..  4    5    5    5    5    5    4    4    4    4      optimistic 641+ from 633
               latest   4 ..  4    4    4    4    4    4    4    4    4    4

Before this design latest took its spare as soon as a step could reach 640 and kept it until
the crossing settled: K 0 sync 2 at 639 (every: at 640), lag 1 2 at 638-639 (every: 639-640);
K 3 sync 5 at 636-639 (every: 637 only), lag 1 5 at 632-639 (every: 633-637).

latest's checkpoint block exists only between the crossing step's ``accept_drafts`` (it is
taken there, and B's state is copied into it) and the ``retire`` that follows (it is
published and freed): 2 + K there, never at a planned step. With nspec 0 (no verify) the
boundary is tagged on the running block as in every. 640 is published in every latest run.
"""

from __future__ import annotations

import pytest

from mambakv import KVCacheCoordinator, Request
from tests.coord_helpers import coordinator, tokens
from tests.helpers import mamba_spec

SETTLED = range(628, 650)


def pinned(coord: KVCacheCoordinator, rid: str) -> int:
    view = coord.describe(rid)
    assert view is not None
    return sum(1 for b in view.tables[0].block_ids if b)


def drive(mode: str, nspec: int, lag: int, accept=lambda start: 0) -> tuple[dict[int, int], list[int], int]:
    """Returns (pinned after each allocate, keyed by the settled count at planning; pinned
    between each accept_drafts and its retire; the prefix hit of a 641-token probe after the
    request is freed)."""
    coord = coordinator(64, mamba_spec(64, nspec, decode_checkpoints=mode), max_model_len=1024)
    req = Request("r", tokens(500))
    for n in (448, 52):
        if req.num_computed_tokens:
            coord.retire("r", req.num_computed_tokens)
        assert coord.allocate(req, n) is not None
        req.num_computed_tokens += n
    req.append_output_token_ids(1)
    coord.retire("r", 500)
    in_flight: list[int] = []
    settled, per_step, at_verify = 500, {}, []
    while settled < 700:
        assert coord.allocate(req, 1 + nspec, num_draft_tokens=nspec) is not None
        req.num_computed_tokens += 1 + nspec  # optimistic under async
        coord.take_copy_plan(), coord.take_zero_plan(), coord.take_checkpoint_writes()
        in_flight.append(settled)
        if settled in SETTLED:
            per_step[settled] = pinned(coord, "r")
        while len(in_flight) > lag:
            in_flight.pop(0)
            a = accept(settled)
            coord.accept_drafts("r", a)
            at_verify.append(pinned(coord, "r"))
            req.num_computed_tokens -= nspec - a
            settled += 1 + a
            req.append_output_token_ids([1] * (1 + a))
            coord.retire("r", settled)
        coord.check_invariants()
    probe = Request("p", [int(x) for x in req.all_token_ids[:641]])
    coord.free("r")
    assert coord.block_pool.get_num_free_blocks() == 63
    return per_step, at_verify, coord.get_computed_blocks(probe)[1]


def row(per_step: dict[int, int]) -> list[int]:
    return [per_step[s] for s in range(628, 646)]


#: every's pinned blocks at the steps planned at settled 628 .. 645 (nspec, lag)
EVERY = {
    (0, 0): [1] * 12 + [2] + [1] * 5,
    (0, 1): [1] * 11 + [2, 2] + [1] * 5,
    (3, 0): [4] * 9 + [5] + [4] * 8,
    (3, 1): [4] * 5 + [5] * 5 + [4] * 8,
}


@pytest.mark.parametrize("nspec", [0, 3])
@pytest.mark.parametrize("lag", [0, 1])
def test_latest_never_pins_more_than_every_at_any_step(nspec, lag):
    """Issue 16's hard requirement, per planned step, inside and outside the crossing window
    (the module docstring's table)."""
    every, _, every_hit = drive("every", nspec, lag)
    latest, at_verify, latest_hit = drive("latest", nspec, lag)
    assert row(every) == EVERY[nspec, lag]
    assert row(latest) == (row(every) if nspec == 0 else [4] * 18)
    assert all(latest[s] <= every[s] for s in every)
    assert max(every.values()) == 2 + nspec
    # latest's checkpoint exists only between a crossing's verify and its retire
    assert max(at_verify, default=1 + nspec) <= 2 + nspec
    assert latest_hit == 640 and every_hit == (640 if nspec == 0 else 448)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_crossing_inside_the_step(lag):
    """3 drafts; one step accepts all 3: sync the step from 637 settles at 641, past 640
    (640's state is scratch block 2's); lag 1 the step from 636 settles exactly on 640
    (scratch block 3). Either way 640's state is copied out at that verify and published at
    its retire; every grows at the same step and publishes no decode state (its running slot
    had moved past 640 when the verify landed)."""
    start = 637 if lag == 0 else 636
    script = lambda s: 3 if s == start else 0  # noqa: E731
    every, _, every_hit = drive("every", 3, lag, script)
    latest, at_verify, latest_hit = drive("latest", 3, lag, script)
    assert all(latest[s] <= every[s] for s in every) and set(latest.values()) == {4}
    assert max(every.values()) == 5 and at_verify.count(5) == 3  # crossings 512, 576, 640
    assert latest_hit == 640 and every_hit == 448


def test_spec_bound():
    assert mamba_spec(64, 3).blocks_per_running_request == 2 + 3
    assert mamba_spec(64, 3, decode_checkpoints="latest").blocks_per_running_request == 5
    assert mamba_spec(64, 0, mode="lazy").blocks_per_running_request == 2  # the 0.x name: latest
