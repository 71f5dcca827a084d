"""Errors raised by mambakv.

Every error the library raises on bad input derives from :class:`MambaKVError`, and is raised
*before* any state changes: a failed call leaves the pool, every block table and the prefix
cache exactly as they were.  Subclasses also derive from the closest built-in exception so
that ``except ValueError`` style handlers keep working.
"""

from __future__ import annotations

import math
import numbers
import operator


class MambaKVError(Exception):
    """Base class of every error mambakv raises on bad input or misuse."""


class InvalidTokenCountError(MambaKVError, ValueError):
    """A token count is negative, zero where progress is required, or beyond `max_model_len`."""


class DoubleFreeError(MambaKVError, RuntimeError):
    """A block at ref count 0 was freed, or one call listed the same block twice."""


class OutOfBlocksError(MambaKVError, RuntimeError):
    """More blocks were requested than are free, where raising is the contract."""


class InvalidSpecError(MambaKVError, ValueError):
    """A KV-cache spec, group or config cannot be built (bad size, shape, dtype or mode)."""


class StaleCacheHitError(MambaKVError, RuntimeError):
    """A prefix hit handed to `allocate` was evicted and reused since `get_computed_blocks`."""


class HashBlockSizeMismatchError(MambaKVError, ValueError):
    """A request's hash block size does not match the coordinator's, or does not divide a
    group's block size."""


class InvalidBlockError(MambaKVError, ValueError):
    """A block list names a real block twice where blocks must be distinct (a hit list given to
    `touch`: no block table holds a block twice), or a block id outside ``0 .. num_blocks - 1``."""


class BlockNotFreeError(MambaKVError, RuntimeError):
    """`FreeBlockQueue.remove` was given a block that is not in the queue."""


class InvalidDraftCountError(MambaKVError, ValueError):
    """`accept_drafts` got a count outside ``0..num_draft_tokens`` of the verified step."""


class ModelConfigError(MambaKVError, ValueError):
    """A model `config.json` is missing a field, names an unknown model, or has bad values."""


class TraceFormatError(MambaKVError, ValueError):
    """A workload trace file is missing or has a malformed line."""


class InvalidCopyPlanError(MambaKVError, ValueError):
    """A state copy / zero plan for `MambaStatePool` is invalid: an id out of range, the null
    block as a destination, a destination twice, or a source that another pair writes."""


class InvalidHashError(MambaKVError, TypeError):
    """A hash-chain input has the wrong type: a parent digest that is not bytes, or a seed
    of ``init_none_hash`` that is not an int."""


class InvalidRequestError(MambaKVError, ValueError):
    """A request is malformed (its id is not a str, a bad ``max_tokens``), or its id belongs
    to another live request."""


class InvalidClockError(MambaKVError, ValueError):
    """An engine clock value (``now=``, seconds) that is not a finite real number."""


class LoadPendingError(MambaKVError, RuntimeError):
    """A request whose host-tier load is not complete was allocated or looked up again, or a
    load was completed / aborted that is not in flight (``complete_load``, ``abort_load``)."""


class InvalidFenceError(MambaKVError, ValueError):
    """``transfers_done`` with a fence no ``take_transfer_plan`` issued (not an int, negative,
    or above the last plan's)."""


class UnsupportedEngineError(MambaKVError, RuntimeError):
    """An engine integration cannot run here: another version of the engine than the one it
    was written for, or an engine feature it refuses (``mambakv.integrations.vllm``). The
    message is one line naming the version or the feature."""


class ReadOnlyResultError(MambaKVError, TypeError):
    """A change to a result every caller shares: the empty ``KVCacheBlocks`` that ``allocate``
    returns for a step that takes no block and ``get_computed_blocks`` for a miss (copy its
    lists first: ``list(blocks.blocks[g])``)."""


def as_seconds(value: object, name: str = "now") -> float:
    """`value` as a finite float >= 0 (ints, floats, numpy numbers, any ``numbers.Real``; not
    bools): a reading of the engine's monotonic clock, in seconds.

    Raises:
        InvalidClockError: anything else, including a negative reading and an int too large
            for a float.
    """
    if type(value) is float and value - value == 0.0 and value >= 0.0:  # the common case
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidClockError(f"{name} must be a finite number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (OverflowError, ValueError):
        raise InvalidClockError(f"{name} must be a finite number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidClockError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def as_count(value: object, name: str, minimum: int = 0,
             error: type[MambaKVError] = InvalidTokenCountError) -> int:
    """`value` as an int >= `minimum` (ints and numpy integers; not bools, floats or strings).

    Raises:
        `error` (InvalidTokenCountError by default): anything else.
    """
    if type(value) is int:
        count = value
    elif isinstance(value, bool) or not hasattr(value, "__index__"):
        raise error(f"{name} must be an int, got {value!r}")
    else:
        count = operator.index(value)
    if count < minimum:
        raise error(f"{name} must be >= {minimum}, got {count!r}")
    return count
