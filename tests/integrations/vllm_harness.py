"""A CPU harness for vLLM 0.33.0's real Scheduler with fake model outputs (no model runs).

Builds a ``VllmConfig`` for a tiny Llama-shaped model (a ``config.json`` only: no weights, no
tokenizer), a ``KVCacheConfig`` of one full-attention group (or a hybrid one: attention +
Mamba in align mode), and drives ``schedule`` ->
``update_from_output`` the way vLLM's engine core does: synchronously, or with one step in
flight (async scheduling: step t + 1 is scheduled before step t's outputs are processed).
The fake model samples a deterministic token per (request, output index), so two runs that
schedule the same steps see the same tokens.

Each step is recorded as plain data (scheduled tokens, computed tokens, new / resumed
requests' block ids, the worker's append-only tables, preemptions, finishes, free blocks,
usage, events, prefix-cache stats), so a run on mambakv and one on vLLM's own manager compare
with ``==``. With Mamba groups every step also checks that mambakv's planned state copies are
the ones vLLM's align-mode worker derives from the tables (``WorkerMambaCopies``). Imported only by tests that ``pytest.importorskip("vllm")`` first.
"""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def write_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def make_vllm_config(model: Path, *, async_scheduling: bool, scheduler_cls: str | None = None,
                     max_num_seqs: int = 8, max_num_batched_tokens: int = 96, max_model_len: int = 1024,
                     enable_prefix_caching: bool = True, num_spec_tokens: int = 0, watermark: float = 0.0,
                     reserve_full_isl: bool = True) -> VllmConfig:
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32")
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, is_encoder_decoder=False, async_scheduling=async_scheduling,
                         scheduler_cls=scheduler_cls, watermark=watermark,
                         scheduler_reserve_full_isl=reserve_full_isl, enable_chunked_prefill=True)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=enable_prefix_caching)
    spec = (SpeculativeConfig(method="ngram", num_speculative_tokens=num_spec_tokens, prompt_lookup_max=4,
                              prompt_lookup_min=2) if num_spec_tokens else None)
    return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig(device="cpu"),
                      kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
                      speculative_config=spec)


def make_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn", "model.layers.1.self_attn"],
                                                           spec)])


def make_hybrid_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """One full-attention group and one Mamba group (align mode), both of BLOCK tokens."""
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mamba = MambaSpec(block_size=BLOCK, shapes=((2, 4), (4, 4)), dtypes=(torch.float32, torch.float32),
                      mamba_cache_mode="align")
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn"], attn),
                                          KVCacheGroupSpec(["model.layers.1.mamba"], mamba)])


def make_scheduler(cls: type, vllm_config: VllmConfig, num_blocks: int, *, log_stats: bool = True,
                   hybrid: bool = False) -> Any:
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if hybrid:
        vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = make_hybrid_kv_cache_config(num_blocks) if hybrid else make_kv_cache_config(num_blocks)
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK, log_stats=log_stats)


class WorkerMambaCopies:
    """The Mamba state copies vLLM 0.33's GPU worker makes in align mode, derived the way its
    ``preprocess_mamba`` derives them: per request it remembers the table column of the last
    running state (for a new or resumed request ``(computed - 1) // block``), the step's running
    state goes to column ``cdiv(computed + scheduled, block) - 1``, and a state that moved is
    copied from the old column to the new one, in every Mamba group's table."""

    def __init__(self, mamba_gids: list[int]) -> None:
        self.mamba_gids = mamba_gids
        self.column: dict[str, int] = {}

    def step(self, out: Any, tables: dict[str, list[list[int]]]) -> dict[int, set[tuple[int, int]]]:
        cached = out.scheduled_cached_reqs
        for rid in [*out.finished_req_ids, *(out.preempted_req_ids or ()), *cached.resumed_req_ids]:
            self.column.pop(rid, None)
        computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        copies: dict[int, set[tuple[int, int]]] = {g: set() for g in self.mamba_gids}
        for rid, n in out.num_scheduled_tokens.items():
            prev = self.column.get(rid, (computed[rid] - 1) // BLOCK)
            curr = -(-(computed[rid] + n) // BLOCK) - 1
            self.column[rid] = curr
            if prev != -1 and prev != curr:
                for g in self.mamba_gids:
                    copies[g].add((tables[rid][g][prev], tables[rid][g][curr]))
        return copies



@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int


def random_workload(seed: int, num_requests: int = 24, *, num_prefixes: int = 3, max_prompt: int = 200,
                    max_output: int = 24, span: int = 40) -> list[Arrival]:
    """Requests that arrive over `span` steps; prompts share one of a few prefixes (so they
    hit), of random lengths, with random output lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randrange(BLOCK, 6 * BLOCK))] for _ in range(num_prefixes)]
    out = []
    for i in range(num_requests):
        head = prefixes[rng.randrange(num_prefixes)] if rng.random() < 0.8 else []
        tail = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, max(2, max_prompt - len(head))))]
        out.append(Arrival(rng.randrange(span), f"req-{i}", tuple(head + tail), rng.randrange(1, max_output)))
    return sorted(out, key=lambda a: (a.step, a.request_id))


def token_for(request_id: str, index: int) -> int:
    """The fake model's sampled token: deterministic per request and output index."""
    return 3 + (sum(map(ord, request_id)) * 31 + index * 7919) % 997


class RecordingPublisher:
    """Stands in for vLLM's event publisher: keeps every published batch's events."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


@dataclass
class Run:
    steps: list[dict[str, Any]] = field(default_factory=list)
    finished: dict[str, list[int]] = field(default_factory=dict)
    stats: list[tuple[int, ...]] = field(default_factory=list)
    #: after the last step: reset_prefix_cache()'s result, its events, the next stats' reset
    #: flag, the free blocks, the usage
    end: tuple[Any, ...] = ()


def _event_tuple(ev: Any) -> tuple[Any, ...]:
    name = type(ev).__name__
    if name == "BlockStored":
        return (name, tuple(ev.block_hashes), ev.parent_block_hash, tuple(ev.token_ids), ev.block_size, ev.lora_id,
                ev.medium, ev.lora_name, ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
    if name == "BlockRemoved":
        return (name, tuple(ev.block_hashes), ev.medium, ev.group_idx)
    return (name,)


def drive(sched: Any, workload: list[Arrival], *, in_flight: int, max_steps: int = 2000,
          check: Any = None, num_drafts: int = 0) -> Run:
    """Run `workload` to the end on `sched`; `in_flight` 0 (synchronous) or 1 (async). `check`,
    when given, is called with the scheduler after every step (invariants). `num_drafts` > 0:
    synchronously, the fake drafter proposes that many tokens after every sampled step (as
    the engine core's ``update_draft_token_ids``; under async scheduling vLLM schedules
    placeholder drafts itself); a verify accepts a deterministic number of them (0 .. all)."""
    publisher = RecordingPublisher()
    sched.kv_event_publisher = publisher
    manager = sched.kv_cache_manager
    pending = deque(workload)
    queue: deque[tuple[Any, set[str]]] = deque()
    mamba_gids = [g for g, group in enumerate(sched.kv_cache_config.kv_cache_groups)
                  if isinstance(group.kv_cache_spec, MambaSpec)]
    worker_copies = WorkerMambaCopies(mamba_gids) if mamba_gids else None
    worker: dict[str, list[list[int]]] = {}
    outputs_so_far: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    run = Run()
    step = 0

    def process(out: Any, sampling: set[str]) -> None:
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            if rid in sampling:
                k = outputs_so_far.get(rid, 0)
                drafts = out.scheduled_spec_decode_tokens.get(rid, ())
                a = (sum(map(ord, rid)) + k) % (len(drafts) + 1)  # drafts accepted
                outputs_so_far[rid] = k + a + 1
                sampled.append([token_for(rid, k + j) for j in range(a + 1)])
            else:
                sampled.append([])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        eco = sched.update_from_output(out, mro)
        if num_drafts and not in_flight:
            proposing = [rid for rid in req_ids if rid in sampling and rid in sched.requests]
            sched.update_draft_token_ids(DraftTokenIds(proposing, [
                [token_for(rid, 5000 + outputs_so_far[rid] + j) for j in range(num_drafts)] for rid in proposing]))
        for outs in eco.values():
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    run.finished[o.request_id] = tokens.pop(o.request_id)
            st = outs.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                p = st.prefix_cache_stats
                run.stats.append((p.reset, p.requests, p.queries, p.hits, p.preempted_requests, p.preempted_queries,
                                  p.preempted_hits))

    while (pending or sched.has_requests() or queue) and step < max_steps:
        while pending and pending[0].step <= step:
            a = pending.popleft()
            sched.add_request(Request(a.request_id, list(a.prompt),
                                      SamplingParams(max_tokens=a.max_tokens, ignore_eos=True), None,
                                      block_hasher=HASHER, arrival_time=float(a.step)))
        out = sched.schedule()
        sampling = {rid for rid in out.num_scheduled_tokens if not sched.requests[rid].is_prefill_chunk}
        for new in out.scheduled_new_reqs:
            worker[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                worker[rid] = [list(ids) for ids in new_ids] if new_ids is not None else [[]]
            elif new_ids is not None:
                for table, ids in zip(worker[rid], new_ids):
                    table.extend(ids)
        for rid in out.num_scheduled_tokens:  # the worker rule: same length, equal wherever the manager's is not null
            for table, ids in zip(worker[rid], manager.get_block_ids(rid), strict=True):
                assert len(table) == len(ids) and all(b == w for w, b in zip(table, ids) if b), (step, rid)
        if worker_copies is not None:
            implied = worker_copies.step(out, worker)
            plan = getattr(manager, "last_step_plan", None)
            if plan is not None:  # mambakv: its planned copies are the ones vLLM's worker makes
                planned = {g: set(plan.group(g).copies) for g in mamba_gids}
                assert planned == implied, (step, planned, implied)
        run.steps.append({
            "scheduled": dict(out.num_scheduled_tokens),
            "spec": {k: list(v) for k, v in out.scheduled_spec_decode_tokens.items()},
            "new": [(n.req_id, n.num_computed_tokens, tuple(map(tuple, n.block_ids))) for n in out.scheduled_new_reqs],
            "cached": [(rid, cached.num_computed_tokens[i], rid in cached.resumed_req_ids,
                        None if cached.new_block_ids[i] is None else tuple(map(tuple, cached.new_block_ids[i])))
                       for i, rid in enumerate(cached.req_ids)],
            "preempted": sorted(out.preempted_req_ids or ()),
            "zero": sorted(out.new_block_ids_to_zero or ()),
            "finished": sorted(out.finished_req_ids),
            "free": manager.block_pool.get_num_free_blocks(),
            "usage": round(manager.usage, 12),
            "tables": {rid: manager.get_block_ids(rid) for rid in sorted(out.num_scheduled_tokens)},
        })
        queue.append((out, sampling))
        while len(queue) > in_flight or (queue and not out.num_scheduled_tokens):
            process(*queue.popleft())
        run.steps[-1]["events"] = [_event_tuple(e) for e in publisher.events]
        publisher.events.clear()
        if check is not None:
            check(sched)
        step += 1
    assert not pending and not sched.has_requests(), f"workload not done after {max_steps} steps"
    # everything freed: reset the prefix cache (its event, the stats' reset flag, the free count)
    reset = sched.reset_prefix_cache()
    p = manager.make_prefix_cache_stats()
    run.end = (reset, [_event_tuple(e) for e in manager.take_events()], None if p is None else p.reset,
               manager.block_pool.get_num_free_blocks(), manager.usage)
    return run
