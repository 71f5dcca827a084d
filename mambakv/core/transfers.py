"""What the host tier hands the engine: transfers between GPU and host memory, as plans.

A transfer copies one block's bytes between the tiers. Each tier has its own id space (GPU ids:
the device pools'; host ids: the host arena's), but the bytes of a page or a state slot are laid
out alike on both (the host arena mirrors the device layout: :mod:`mambakv.device.host_arena`), so
a transfer is ``(src_tier, src_block, dst_tier, dst_block)`` plus its kind, group and bytes::

    TransferPlan(stores=(Transfer(GPU, 17, HOST, 3, 65536, PAGE, 0),     D2H: write GPU page 17
                         Transfer(GPU, 5, HOST, 9, 39518208, STATE, 1)),  to host page 3, ...
                 loads=(LoadPlan("r7", (Transfer(HOST, 3, GPU, 40, ...), ...), 65536, 64),))

Order (the contract an engine follows; one side stream is enough): run plans in the order they
were taken, a plan's ``stores`` before its ``loads``. A load's destination blocks are held for its
request; call ``KVCacheCoordinator.complete_load(request_id)`` when its copies are done.

**The fence.** Each non-empty plan carries a ``fence`` number (1, 2, ...). The GPU blocks its
copies read or write stay out of the free queue until the engine reports them done with
``KVCacheCoordinator.transfers_done(plan.fence)`` (every plan up to that fence), so a copy that
lands late never writes a block another request holds, nor reads one it rewrote::

    step 5   take_transfer_plan() -> fence 3: store GPU page 17 -> host 3; load host 9 -> GPU 40 (r7)
    step 5   free("r7")              GPU 40 is not freed: fence 3 holds it (its copy may be running)
             free("q")               its pages were read by fence 3's stores: held, not reusable
    step 6   the side stream's event for fence 3 completed -> transfers_done(3): 40 and 17 free

On one stream, copies ordered before the step's forward, call ``transfers_done(plan.fence)``
right after enqueueing them. With ``HostWrite.EVICT`` a store reads blocks the evicting step
hands to another request at once: those stores must finish before that step writes GPU memory
(run them first on its stream, or wait for them); the fence holds nothing for them.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

__all__ = ["EMPTY_TRANSFER_PLAN", "BlockKind", "LoadPlan", "Tier", "Transfer", "TransferPlan", "transfer_pairs"]


class Tier(str, Enum):
    """Where a block lives."""

    GPU = "gpu"
    HOST = "host"


class BlockKind(str, Enum):
    """What a block holds: an attention page (``page_bytes``) or a Mamba state slot (``state_bytes``)."""

    PAGE = "page"
    STATE = "state"


class Transfer(NamedTuple):
    """One block's copy between the tiers: ``num_bytes`` bytes from ``src_block`` in ``src_tier``
    to ``dst_block`` in ``dst_tier`` (ids of the pool of `kind`; `group_id`: the KV-cache group
    the block serves, for engines that keep one view per group)."""

    src_tier: Tier
    src_block: int
    dst_tier: Tier
    dst_block: int
    num_bytes: int
    kind: BlockKind
    group_id: int


class LoadPlan(NamedTuple):
    """The host-to-GPU copies of one request's host hit (``get_computed_blocks_tiered``).

    Attributes:
        request_id: the request that waits for them (``complete_load(request_id)`` when done).
        transfers: HOST -> GPU copies: the hit's pages missing on the GPU, then its states.
        num_bytes: their bytes in total.
        num_tokens: the hit tokens they add to the GPU part.
    """

    request_id: str
    transfers: tuple[Transfer, ...]
    num_bytes: int
    num_tokens: int


class TransferPlan(NamedTuple):
    """A step's transfers (``take_transfer_plan()``): stores (GPU -> HOST) first, then the loads
    started since the last drain, per request; `fence`: the number to pass to
    ``transfers_done`` once they ran (0 for the empty plan, which needs none)."""

    stores: tuple[Transfer, ...]
    loads: tuple[LoadPlan, ...]
    fence: int = 0

    @property
    def bytes_d2h(self) -> int:
        return sum(t.num_bytes for t in self.stores)

    @property
    def bytes_h2d(self) -> int:
        return sum(p.num_bytes for p in self.loads)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


EMPTY_TRANSFER_PLAN = TransferPlan((), ())


def transfer_pairs(transfers: tuple[Transfer, ...] | list[Transfer], kind: BlockKind) -> list[tuple[int, int]]:
    """``(src_block, dst_block)`` of the transfers of `kind`, in order (one batched copy per kind)."""
    kind = BlockKind(kind)
    return [(t.src_block, t.dst_block) for t in transfers if BlockKind(t.kind) is kind]
