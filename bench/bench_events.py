"""KV event publishing: what ``ZmqEventPublisher.publish`` costs the scheduler's thread.

A hybrid model shaped like Qwen3-Next (1 full-attention + 3 Mamba groups, block 16 here so that
many blocks are stored and evicted), 600 steps of the tests' synchronous mini engine: prompts of
512-4096 tokens from 8 shared prefixes, 512-token chunks, 8 output tokens, a 2000-block pool.
Reported per step: the engine step itself, and ``publish_from`` (the announce rule and the
queue hand-over; the encoding and the send run on the publisher's thread), against
``take_events()`` alone.

Run: ``pytest bench/bench_events.py --benchmark-only`` (needs the events extra)
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest
from common import py_ref_ms

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mambakv.events import ZmqEventPublisher  # noqa: E402
from tests.coord_helpers import coordinator, fa_spec  # noqa: E402
from tests.event_driver import MiniEngine  # noqa: E402
from tests.helpers import mamba_spec  # noqa: E402

STEPS = 600


def run_steps(publish: bool) -> tuple[float, float, int]:
    rng = random.Random(3)
    coord = coordinator(2000, fa_spec(16), mamba_spec(16), mamba_spec(16), mamba_spec(16),
                        enable_kv_cache_events=True, max_model_len=1 << 20)
    engine = MiniEngine(coord, 16, rng, chunk_blocks=32)
    families = [[rng.randrange(1, 30000) for _ in range(4096)] for _ in range(8)]
    pub = ZmqEventPublisher.for_coordinator(coord, "tcp://127.0.0.1:0") if publish else None
    t_step = t_pub = 0.0
    for _ in range(STEPS):
        if rng.random() < 0.5:
            fam = rng.choice(families)
            engine.submit(fam[: rng.randrange(512, 4096)] + [rng.randrange(1, 30000) for _ in range(64)], max_tokens=8)
        a = time.perf_counter()
        engine.step()
        b = time.perf_counter()
        if pub is not None:
            pub.publish_from(coord)
        else:
            coord.block_pool.take_events()
        t_step += b - a
        t_pub += time.perf_counter() - b
    sent = 0
    if pub is not None:
        assert pub.flush(30.0) and pub.num_dropped == 0
        sent = pub.num_sent
        pub.close()
    return t_step, t_pub, sent


@pytest.mark.parametrize("publish", [False, True], ids=["take_events", "publish"])
def test_publish_cost(benchmark, publish):
    out = []
    benchmark.pedantic(lambda: out.append(run_steps(publish)), rounds=3)
    step, pub, sent = min(out)
    benchmark.extra_info.update(step_us=step / STEPS * 1e6, publish_us_per_step=pub / STEPS * 1e6,
                                batches_sent=sent, py_ref_ms=py_ref_ms())
