"""Host-tier transfer plans (re-exported from :mod:`mambakv.core.transfers`, where the types and the
order contract are documented) and :class:`~mambakv.plans.TieredHit`."""

from mambakv.core.transfers import (
    EMPTY_TRANSFER_PLAN,
    BlockKind,
    LoadPlan,
    Tier,
    Transfer,
    TransferPlan,
    transfer_pairs,
)
from mambakv.plans import TieredHit

__all__ = ["EMPTY_TRANSFER_PLAN", "BlockKind", "LoadPlan", "TieredHit", "Tier", "Transfer", "TransferPlan",
           "transfer_pairs"]
