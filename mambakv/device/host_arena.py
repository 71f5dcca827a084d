"""A pinned host (CPU) arena mirroring a device layout's rows, and the batched copies of
:mod:`mambakv.core.transfers` plans between the two.

The host arena has the device layout's ``group_size`` raw uint8 tensors with the same row
structure, only its own row count (the host :class:`SuperblockGeometry`'s ``num_superblocks``).
A page id / slot id names the same bytes of every raw tensor on either side, so one transfer
moves those bytes of all ``group_size`` raw tensors (``P = page_bytes_per_layer``,
``S = k x P``, ``L = state_bytes_per_layer = state_bytes // group_size``)::

    device raw[i]  [num_superblocks, S]          host raw[i]  [host num_superblocks, S]
    row sb: | page sb*k | ... | page sb*k+k-1 |   row hb: | page hb*k | ... | page hb*k+k-1 |
            | slot sb: states (L B) | idle    |           | slot hb: states (L B) | idle    |
                  \\____ Transfer(GPU, sb, HOST, hb, state_bytes, STATE, g) ___/

    unified (HybridLayout): device raw[i] [num_blocks, R] <-> host raw[i] [n, R]; a page and a
    state are both one row (host geometry: k = 1, page_bytes = state_bytes = group_size x R).

A PAGE transfer copies bytes ``[p x P, (p + 1) x P)`` of every raw tensor; a STATE transfer
copies the first ``L`` bytes of row ``s`` (the states; the slot's idle tail is not copied).
Host page 0 and host slot 0 are null: never a source or a destination, their bytes stay zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from mambakv.core.arena_geometry import SuperblockGeometry
from mambakv.core.errors import InvalidCopyPlanError, InvalidSpecError
from mambakv.core.transfers import BlockKind, Tier, Transfer, TransferPlan
from mambakv.device.decoupled import DecoupledLayout
from mambakv.device.layout import HybridLayout
from mambakv.device.views import wide_rows

__all__ = ["HostArena"]

_Pairs = dict[BlockKind, tuple[list[int], list[int]]]  # kind -> (source ids, destination ids)


class HostArena:
    """Host memory of ``geometry``'s blocks, laid out like `layout`'s rows.

    Args:
        layout: the device layout (:class:`DecoupledLayout` or unified :class:`HybridLayout`).
        geometry: the host ids: decoupled, the device's ``pages_per_superblock``, ``page_bytes``
            and ``state_bytes`` with its own ``num_superblocks``; unified,
            ``SuperblockGeometry(n, 1, layout.bytes_per_block, layout.bytes_per_block)``.
        pin_memory: page-locked host tensors (async copies); None (default): iff CUDA is available.

    Memory: ``group_size`` zero-filled CPU uint8 tensors ``[geometry.num_superblocks, row]``
    (``row = S`` decoupled, ``page_size_bytes`` unified): ``geometry.total_bytes`` bytes.

    Raises:
        InvalidSpecError: another layout type, a geometry that does not match the layout, or
            ``pin_memory=True`` where CUDA is not available (pinning needs a CUDA driver; no
            silent fallback to pageable memory).
    """

    def __init__(self, layout: DecoupledLayout | HybridLayout, geometry: SuperblockGeometry, *,
                 pin_memory: bool | None = None) -> None:
        if not isinstance(geometry, SuperblockGeometry):
            raise InvalidSpecError(f"geometry must be a SuperblockGeometry, got {type(geometry).__name__}")
        g = geometry
        if isinstance(layout, DecoupledLayout):
            d = layout.geometry
            if (g.pages_per_superblock, g.page_bytes, g.state_bytes) != (
                    d.pages_per_superblock, d.page_bytes, d.state_bytes):
                raise InvalidSpecError(f"host geometry (k={g.pages_per_superblock}, page {g.page_bytes} B, state "
                                       f"{g.state_bytes} B) != the device's (k={d.pages_per_superblock}, page "
                                       f"{d.page_bytes} B, state {d.state_bytes} B)")
            row, page, state = layout.superblock_bytes_per_layer, layout.page_bytes_per_layer, \
                g.state_bytes // layout.group_size
            self._dev_n = {BlockKind.PAGE: layout.num_pages, BlockKind.STATE: layout.num_slots}
        elif isinstance(layout, HybridLayout):
            b = layout.bytes_per_block
            if (g.pages_per_superblock, g.page_bytes, g.state_bytes) != (1, b, b):
                raise InvalidSpecError(f"a unified layout's host geometry needs k=1 and page = state = "
                                       f"{b} B (bytes_per_block), got k={g.pages_per_superblock}, page "
                                       f"{g.page_bytes} B, state {g.state_bytes} B")
            row = page = state = layout.page_size_bytes
            self._dev_n = {BlockKind.PAGE: layout.num_blocks, BlockKind.STATE: layout.num_blocks}
        else:
            raise InvalidSpecError(f"no host arena for layout {type(layout).__name__}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise InvalidSpecError("pin_memory=True needs CUDA (page-locked memory is a CUDA driver "
                                   "allocation); pass pin_memory=None or False")
        self.layout, self.geometry, self.group_size = layout, g, layout.group_size
        self.pinned = bool(pin_memory)
        #: bytes per raw tensor: of one row (``S`` / ``page_size_bytes``), a page id, a slot id's states
        self.row_bytes, self.page_bytes_per_layer, self.state_bytes_per_layer = row, page, state
        self.num_pages, self.num_slots = g.num_pages, g.num_superblocks
        self._unified = isinstance(layout, HybridLayout)
        self._host_n = {BlockKind.PAGE: self.num_pages, BlockKind.STATE: self.num_slots}
        self.raw: tuple[torch.Tensor, ...] = tuple(
            torch.zeros(g.num_superblocks, row, dtype=torch.uint8, pin_memory=self.pinned)
            for _ in range(self.group_size))
        # per kind, per raw tensor: (device rows, host rows), as the widest integer both allow
        self._views: dict[BlockKind, list[tuple[torch.Tensor, torch.Tensor]]] = {
            kind: [_wide_pair(self._rows(r, kind), self._rows(h, kind)) for r, h in zip(layout.raw, self.raw)]
            for kind in BlockKind}

    # ------------------------------------------------------------------ queries
    def _rows(self, raw: torch.Tensor, kind: BlockKind) -> torch.Tensor:
        if kind is BlockKind.PAGE:
            return raw.view(-1, self.page_bytes_per_layer)
        return raw[:, : self.state_bytes_per_layer]

    def rows(self, kind: BlockKind, i: int) -> torch.Tensor:
        """Host raw tensor `i` as `kind` rows (a uint8 view): ``[num_pages, page_bytes_per_layer]``
        (PAGE) or the slots' states ``[num_slots, state_bytes_per_layer]`` (STATE)."""
        return self._rows(self.raw[i], BlockKind(kind))

    def byte_range(self, kind: BlockKind, block_id: int) -> tuple[int, int]:
        """``(byte offset, byte length)`` of host `kind` id `block_id` in every ``raw[i].view(-1)``
        (the bytes a transfer moves). Raises InvalidSpecError: an id out of range."""
        kind = BlockKind(kind)
        n = self._host_n[kind]
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < n:
            raise InvalidSpecError(f"host {kind.value} id {block_id!r} out of range 0 .. {n - 1}")
        if kind is BlockKind.PAGE:
            return block_id * self.page_bytes_per_layer, self.page_bytes_per_layer
        return block_id * self.row_bytes, self.state_bytes_per_layer

    @property
    def total_bytes(self) -> int:
        """Bytes of all host raw tensors (``geometry.total_bytes``)."""
        return self.group_size * self.num_slots * self.row_bytes

    def check_invariants(self) -> None:
        """Assert the null page / slot (host id 0: bytes ``[0, page_bytes_per_layer)`` of every raw
        tensor; the null slot's other bytes are superblock 0's live pages) is all zero."""
        for i, r in enumerate(self.raw):
            assert int(torch.count_nonzero(r.view(-1)[: self.page_bytes_per_layer])) == 0, \
                f"host raw tensor {i}: the null block was written"

    # ------------------------------------------------------------------ copies
    def run_stores(self, transfers: Iterable[Transfer], *, stream: torch.cuda.Stream | None = None) -> int:
        """Copy GPU -> HOST `transfers`: one gather on the device and one scatter into the host
        rows per kind per raw tensor. Returns the bytes moved (their ``num_bytes``).

        On CUDA the device -> host copies are ``non_blocking`` when pinned, then the call waits
        for them (the host scatter needs the bytes): the host bytes are final on return. The
        caller orders `stream` (a ``torch.cuda.Stream``; None: the current one; ignored on CPU)
        after the work that wrote the sources.

        Raises:
            InvalidCopyPlanError (before anything is copied): see :meth:`run`.
        """
        pairs = self._check(list(transfers), to_host=True)
        return self._copy(pairs, to_host=True, stream=stream)

    def run_loads(self, transfers: Iterable[Transfer], *, stream: torch.cuda.Stream | None = None) -> int:
        """Copy HOST -> GPU `transfers`: one host gather and one device scatter per kind per raw
        tensor. Returns the bytes moved. On CUDA the host rows are read (into pinned staging)
        before return and the host -> device copies and scatters are queued on `stream`
        (``non_blocking`` when pinned): the caller syncs with it before reading the blocks.

        Raises:
            InvalidCopyPlanError (before anything is copied): see :meth:`run`.
        """
        pairs = self._check(list(transfers), to_host=False)
        return self._copy(pairs, to_host=False, stream=stream)

    def run(self, plan: TransferPlan, *, stream: torch.cuda.Stream | None = None) -> int:
        """Run `plan`: its stores, then the transfers of every load plan in order (one batch).
        Both are checked before anything is copied. Returns the bytes moved.

        Raises:
            InvalidCopyPlanError (nothing copied): a malformed transfer, a wrong direction (a store
                is GPU -> HOST, a load HOST -> GPU), an unknown kind, a non-int id or one out of
                range of its side (device: the layout's pages / slots / blocks; host: the host
                geometry's), the null id 0 as a source or destination, a destination twice (or,
                decoupled, a slot's superblock also a page destination) in one batch,
                ``num_bytes`` other than the geometry's ``page_bytes`` (PAGE) / ``state_bytes`` (STATE),
                or `plan` not a TransferPlan.
        """
        if not isinstance(plan, TransferPlan):
            raise InvalidCopyPlanError(f"run needs a TransferPlan (take_transfer_plan()), got {type(plan).__name__}")
        stores = self._check(list(plan.stores), to_host=True)
        loads = self._check([t for p in plan.loads for t in p.transfers], to_host=False)
        return self._copy(stores, to_host=True, stream=stream) + self._copy(loads, to_host=False, stream=stream)

    def _check(self, transfers: list[Transfer], *, to_host: bool) -> _Pairs:
        want = (Tier.GPU, Tier.HOST) if to_host else (Tier.HOST, Tier.GPU)
        sides = (self._dev_n, self._host_n) if to_host else (self._host_n, self._dev_n)
        k = self.geometry.pages_per_superblock
        pairs: _Pairs = {kind: ([], []) for kind in BlockKind}
        seen: set[tuple[bool, int]] = set()  # destination (is a slot, id); unified: one id space
        sb_pages: set[int] = set()  # destination superblocks holding a page / a slot (decoupled)
        sb_slots: set[int] = set()
        for n, t in enumerate(transfers):
            try:
                src_tier, src, dst_tier, dst, num_bytes, kind, _ = t
                kind = BlockKind(kind)
            except (TypeError, ValueError):
                raise InvalidCopyPlanError(f"transfer {n}: not a Transfer of a known kind: {t!r}") from None
            if (src_tier, dst_tier) != want:
                raise InvalidCopyPlanError(f"transfer {n}: {src_tier} -> {dst_tier}, this batch is "
                                           f"{want[0].value} -> {want[1].value}: {t!r}")
            for side, (what, block) in enumerate((("source", src), ("destination", dst))):
                limit = sides[side][kind]
                if isinstance(block, bool) or not isinstance(block, int) or not 0 < block < limit:
                    raise InvalidCopyPlanError(f"transfer {n}: {what} {kind.value} id {block!r} not in "
                                               f"1 .. {limit - 1} (0 is null): {t!r}")
            expect = self.geometry.page_bytes if kind is BlockKind.PAGE else self.geometry.state_bytes
            if num_bytes != expect:
                raise InvalidCopyPlanError(f"transfer {n}: num_bytes {num_bytes!r} != {expect} for a "
                                           f"{kind.value}: {t!r}")
            slot = kind is BlockKind.STATE
            key = (False, dst) if self._unified else (slot, dst)
            sb = dst if slot else dst // k
            if key in seen or (not self._unified and sb in (sb_pages if slot else sb_slots)):
                raise InvalidCopyPlanError(f"transfer {n}: destination {kind.value} {dst} overlaps another "
                                           f"destination of this batch: {t!r}")
            seen.add(key)
            (sb_slots if slot else sb_pages).add(sb)
            pairs[kind][0].append(src)
            pairs[kind][1].append(dst)
        return pairs

    def _copy(self, pairs: _Pairs, *, to_host: bool, stream: torch.cuda.Stream | None) -> int:
        dev = self.layout.device
        cuda = dev.type == "cuda"
        nb = cuda and self.pinned
        ctx = torch.cuda.stream(stream) if cuda and stream is not None else contextlib.nullcontext()
        moved = 0
        with ctx:
            scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            for kind, (src, dst) in pairs.items():
                if not src:
                    continue
                moved += len(src) * (self.geometry.page_bytes if kind is BlockKind.PAGE else self.geometry.state_bytes)
                dev_ids, host_ids = (src, dst) if to_host else (dst, src)
                dev_idx = torch.tensor(dev_ids, dtype=torch.long, device=dev)
                host_idx = torch.tensor(host_ids, dtype=torch.long)
                for d, h in self._views[kind]:
                    if to_host:
                        rows = d.index_select(0, dev_idx)
                        if cuda:
                            staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=self.pinned)
                            rows = staged.copy_(rows, non_blocking=nb)
                        scatters.append((h, host_idx, rows))
                    else:
                        rows = torch.empty((len(src), h.shape[1]), dtype=h.dtype, pin_memory=nb)
                        torch.index_select(h, 0, host_idx, out=rows)
                        d.index_copy_(0, dev_idx, rows.to(dev, non_blocking=nb))
            if scatters and cuda:
                torch.cuda.current_stream(dev).synchronize()  # the D2H copies land before the scatter
            for h, idx, rows in scatters:
                h.index_copy_(0, idx, rows)
        return moved

    def __repr__(self) -> str:
        g = self.geometry
        return (f"HostArena({'unified' if self._unified else 'decoupled'}, group_size={self.group_size}, "
                f"superblocks={g.num_superblocks} x {g.pages_per_superblock} pages of {self.page_bytes_per_layer} B "
                f"per layer, pinned={self.pinned})")


def _wide_pair(dev: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dev, host)`` as the widest integer rows both allow (the same dtype on both sides)."""
    d, h = wide_rows(dev), wide_rows(host)
    return (d, h) if d.dtype == h.dtype else (dev, host)
