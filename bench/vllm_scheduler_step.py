"""vLLM 0.33.0's whole scheduler step (``schedule`` + ``update_from_output``) with mambakv as its
``kv_cache_manager`` against vLLM's own manager, at N running decode requests (CPU, fake model
outputs, the harness of tests/integrations/vllm_harness.py; needs scripts/install_vllm_cpu.sh).

Every request has a 32-token prompt (no shared prefix) and decodes; once all N are in decode
the script times `--steps` synchronous steps, best of `--repeat`, per scheduler class. It also
times the calls the scheduler makes on its manager in those steps (every public method of the
manager wrapped with a timer): the manager's share of the step.

    python bench/vllm_scheduler_step.py --num-reqs 256 1024

Output: one line per N with both step times (us), the ratio mambakv / vLLM, and both managers'
shares (us per step) and their ratio. Compare ratios only: these machines drift.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from mambakv.integrations.vllm import Scheduler
from tests.integrations import vllm_harness as h

MANAGER_CALLS = ("allocate_slots", "get_computed_blocks", "cache_blocks", "free", "get_blocks", "get_block_ids",
                 "take_events", "new_step_starts", "take_new_block_ids", "take_kv_cache_block_copies",
                 "take_boundary_state_offloads", "make_prefix_cache_stats", "record_prefix_cache_stats",
                 "estimate_cached_tokens")


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, manager: Any) -> None:
        for name in MANAGER_CALLS:
            fn = getattr(manager, name, None)
            if fn is None:
                continue

            def timed(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(manager, name, timed)


def one_run(cls: type, model: Path, num_reqs: int, steps: int) -> tuple[float, float]:
    config = h.make_vllm_config(model, async_scheduling=False, max_num_seqs=num_reqs,
                                max_num_batched_tokens=8192, max_model_len=4096)
    sched = h.make_scheduler(cls, config, num_reqs * 20 + 16)
    sched.kv_event_publisher = h.RecordingPublisher()
    for i in range(num_reqs):
        prompt = [3 + (i * 37 + j * 11) % 997 for j in range(32)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True), None,
                                  block_hasher=h.HASHER))
    counter = [0]

    def step() -> None:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if sched.requests[r].is_prefill_chunk else [3 + (counter[0] + k) % 997]
                   for k, r in enumerate(ids)]
        counter[0] += 1
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                                        sampled_token_ids=sampled))
        sched.kv_event_publisher.events.clear()

    while len(sched.running) < num_reqs or any(r.is_prefill_chunk for r in sched.running):
        step()
    for _ in range(5):
        step()
    timer = Timer()
    timer.wrap(sched.kv_cache_manager)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    total = time.perf_counter() - t0
    return total / steps, timer.seconds / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-reqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = h.write_model(Path(tempfile.mkdtemp()) / "tiny-llama")
    for n in args.num_reqs:
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeat):  # interleaved, so drift hits both alike
            for name, cls in (("mambakv", Scheduler), ("vllm", VllmScheduler)):
                step_s, mgr_s = one_run(cls, model, n, args.steps)
                if name not in best or step_s < best[name][0]:
                    best[name] = (step_s, mgr_s)
        (ms, mm), (vs, vm) = best["mambakv"], best["vllm"]
        print(f"num_reqs={n} step_us_mambakv={ms * 1e6:.0f} step_us_vllm={vs * 1e6:.0f} step_ratio={ms / vs:.3f} "
              f"manager_us_mambakv={mm * 1e6:.0f} manager_us_vllm={vm * 1e6:.0f} manager_ratio={mm / vm:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
