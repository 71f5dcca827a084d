"""VllmRequestView: a vLLM ``Request`` as mambakv's EngineRequest, read in place.

vLLM keeps every request (token ids, counts, and the block hashes its own hasher computed at
the scheduler's ``hash_block_size``); the view reads those fields where vLLM keeps them, so
nothing is copied, no token is hashed by mambakv, and the KV events carry vLLM's hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mambakv.core.errors import HashBlockSizeMismatchError
from mambakv.core.retention import Retention, parse_retention

__all__ = ["VllmRequestView"]

_NORMAL = parse_retention(None)


class VllmRequestView:
    """One vLLM request as the coordinator sees it (the EngineRequest protocol).

    Args:
        request: the vLLM ``vllm.v1.request.Request`` (kept, never copied).
        hash_block_size: tokens per entry of ``request.block_hashes`` (the scheduler's
            ``hash_block_size``).

    ``num_computed_tokens`` reads and writes vLLM's own count (the scheduler advances it);
    ``num_admissions`` is the view's (one view lives from a request's first admission to its
    finish, preemptions included, so a resumed request counts as preempted in the
    prefix-cache statistics exactly when vLLM's ``num_preemptions > 0``).
    """

    __slots__ = ("request", "request_id", "num_prompt_tokens", "num_admissions", "lora_id", "lora_name",
                 "_hash_block_size")

    def __init__(self, request: Any, hash_block_size: int) -> None:
        self.request = request
        self.request_id: str = request.request_id
        self.num_prompt_tokens: int = request.num_prompt_tokens
        self.num_admissions = 0
        lora = request.lora_request
        self.lora_id: int | None = None if lora is None else lora.adapter_id
        self.lora_name: str | None = None if lora is None else lora.name
        self._hash_block_size = hash_block_size

    @property
    def num_computed_tokens(self) -> int:
        n: int = self.request.num_computed_tokens
        return n

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.request.num_computed_tokens = value

    @property
    def num_tokens(self) -> int:
        n: int = self.request.num_tokens
        return n

    @property
    def all_token_ids(self) -> Sequence[int]:
        ids: Sequence[int] = self.request.all_token_ids
        return ids

    @property
    def block_hashes(self) -> Sequence[bytes]:
        hashes: Sequence[bytes] = self.request.block_hashes
        return hashes

    @property
    def hash_block_size(self) -> int:
        return self._hash_block_size

    def set_hash_block_size(self, hash_block_size: int) -> None:
        """vLLM hashed at its own size: another one is refused.

        Raises:
            HashBlockSizeMismatchError: `hash_block_size` differs from the scheduler's.
        """
        if hash_block_size != self._hash_block_size:
            raise HashBlockSizeMismatchError(
                f"vLLM hashes request {self.request_id!r} in blocks of {self._hash_block_size} tokens, "
                f"the coordinator uses {hash_block_size}")

    @property
    def retain(self) -> Retention:
        return _NORMAL
