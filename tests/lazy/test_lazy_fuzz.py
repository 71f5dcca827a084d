"""Fuzzing ALIGN_LAZY through the coordinator (hypothesis): random requests, prefill chunks,
decode steps with 0..K drafts, async lag up to one step per request, random acceptance,
random spare failures, finishes and preemptions at any point. After every operation:

1. no block an in-flight step may write is published: at ``free`` (the only place a lazy
   checkpoint is published) every target of the request's unresolved steps whose boundary is
   not yet settled, its working block and its scratch rows carry no hash;
2. a failed spare allocation changes no cached block (map, hashes, queue order);
3. pinned blocks per running request stay within the lazy bound: 3 in decode (W + C + S),
   + the prefill's last state until the first decode step settles; scratch rows: 0 or K;
plus the coordinator's ``check_invariants`` (conservation with the reserved region).
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mambakv import Request
from tests.coord_helpers import coordinator, free_queue_ids
from tests.helpers import mamba_spec

BS, K, NUM_BLOCKS, SEQS = 16, 3, 40, 3


def cache_state(pool):
    return ({g: dict(m) for g, m in pool.cached_block_hash_to_block.items()},
            [b.block_hash for b in pool.blocks])


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_lazy_invariants(data):
    coord = coordinator(NUM_BLOCKS, mamba_spec(BS, K, mode="align_lazy"), max_model_len=4096, max_num_seqs=SEQS)
    pool, m = coord.block_pool, coord.managers[0]
    fail = {"on": False}
    original = pool.get_new_unhashed_block

    def spare():
        before = (cache_state(pool), free_queue_ids(coord))
        got = None if fail["on"] else original()
        if got is None:
            assert (cache_state(pool), free_queue_ids(coord)) == before  # 2.
        return got
    pool.get_new_unhashed_block = spare
    reqs: dict[str, dict] = {}
    n_made = 0
    spares = data.draw(st.sampled_from(["work", "fail", "random"]))
    for _ in range(data.draw(st.integers(60, 240))):
        fail["on"] = spares == "fail" or (spares == "random" and data.draw(st.booleans()))
        op = data.draw(st.sampled_from(["new"] + ["plan"] * 10 + ["resolve"] * 10 + ["free"]))
        live = sorted(reqs)
        if op == "new" and len(reqs) < SEQS:
            prompt = data.draw(st.integers(1, 60))
            # shared prefixes (same start token) so that published states get hit
            rid = f"r{n_made}"
            n_made += 1
            req = Request(rid, [7] * data.draw(st.integers(0, prompt)) + list(range(prompt)))
            blocks, hit = coord.get_computed_blocks(req)
            reqs[rid] = {"req": req, "hit": (blocks, hit), "sched": hit, "settled": hit, "steps": deque()}
            continue
        if not live:
            continue
        r = reqs[data.draw(st.sampled_from(live))]
        req, rid = r["req"], r["req"].request_id
        if op == "plan" and len(r["steps"]) < 2:
            P = req.num_prompt_tokens
            blocks, hit = r.pop("hit", (None, 0))
            if r["sched"] < P:
                n = data.draw(st.integers(1, P - r["sched"]))
                out = coord.allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks)
                step = ("p", r["sched"] + n, 0)
            else:
                d = data.draw(st.integers(0, K))
                n = 1 + d
                out = coord.allocate(req, n, num_draft_tokens=d)
                step = ("d", 0, d)
            if out is None:
                if hit or blocks is not None:
                    r["hit"] = (None, 0) if rid in m.req_to_blocks else coord.get_computed_blocks(req)
                continue
            req.num_computed_tokens += hit + n
            if step[0] == "p":
                r["sched"] = step[1]
            r["steps"].append(step)
            coord.take_copy_plan(), coord.take_zero_plan()
            writes = coord.take_checkpoint_writes().get(0, [])
            r.setdefault("targets", []).extend((b, p) for w_rid, b, p in writes if w_rid == rid)
        elif op == "resolve" and r["steps"]:
            kind, end, d = r["steps"].popleft()
            if kind == "p":
                r["settled"] = end
                if end == req.num_prompt_tokens:
                    req.append_output_token_ids(1)
            else:
                a = data.draw(st.integers(0, d))
                if d:  # the engine verifies steps with drafts only
                    coord.accept_drafts(rid, a)
                req.num_computed_tokens -= d - a
                r["settled"] += 1 + a
                r["decoded"] = True
                req.append_output_token_ids([2] * (a + 1))
            coord.retire(rid, r["settled"])
        elif op == "free" and "hit" not in r:
            plan = coord.get_state_plan(rid).get(0)
            at_risk = [b for b, p in r.get("targets", []) if p > r["settled"]]
            if plan is not None and plan.checkpoint_block_id and r["steps"]:  # decode, a step in flight
                at_risk += [plan.working_block_id, *plan.scratch_block_ids]
            coord.free(rid)
            del reqs[rid]
            for b in at_risk:  # 1.
                assert pool.blocks[b].block_hash is None, f"block {b} published while a step may write it"
        coord.check_invariants()
        for rid2, r2 in reqs.items():  # 3.
            if rid2 not in m.req_to_blocks:
                continue
            plan = coord.get_state_plan(rid2).get(0)
            decode = plan is not None and plan.checkpoint_block_id
            # decode: W + C + S, + the prefill's last state until the first decode step settles;
            # prefill: last + running + one state per chunk in flight (lag <= 1)
            assert m.num_held_blocks(rid2) <= 3 + (not r2.get("decoded")), \
                (rid2, coord.get_block_ids(rid2), list(r2["steps"]), r2["settled"], plan)
            assert len(plan.scratch_block_ids) in ((0, K) if decode else (0,)), rid2
    for rid in list(reqs):
        coord.free(rid)
    coord.check_invariants()
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - pool.num_reserved_blocks == NUM_BLOCKS - 1 - SEQS * K
