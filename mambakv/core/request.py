"""Request: token ids (one numpy buffer), computed-token count, and block hashes kept current."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mambakv.core.errors import HashBlockSizeMismatchError, InvalidRequestError, InvalidTokenCountError, as_count
from mambakv.core.hashing import TOKEN_DTYPE, TOKEN_MAX, as_token_array, encode_extra_keys, hash_blocks
from mambakv.core.retention import Retention, parse_retention


class Request:
    """One request as the block manager sees it.

    Args:
        request_id: a str, unique among live requests (may be reused after ``free``).
        prompt_token_ids: list of ints or a 1-D integer numpy array; every id is a
            non-negative int32 (``0 .. 2**31 - 1``). A little-endian int32 array is used as
            is, not copied (the request reads it until its first append): the caller must not
            mutate it afterwards. Anything else is converted once (floats are rejected, not
            truncated).
        hash_block_size: tokens per hash block; None adopts the coordinator's on first use.
        lora_name: LoRA adapter; part of every block's hash.
        lora_id: the adapter's numeric id (vLLM's ``adapter_id``), None or an int >= 0; not
            hashed, only published in KV events (BlockStored.lora_id).
        cache_salt: part of the first block's hash only (isolates tenants).
        mm_hashes: ``(offset, length, content hash)`` per multimodal item, in tokens; an item's
            hash is part of every block that overlaps ``[offset, offset + length)``.
        max_tokens: output tokens allowed, None or >= 0 (informational; used by the
            reference scheduler).
        retain: retention hint of the cached prefix, ``"low"`` / ``"normal"`` / ``"high"`` / a ttl
            in seconds (:mod:`mambakv.core.retention`; used by the decoupled layout's eviction).

    ``block_hashes`` holds one 16-byte digest per full hash block of ``all_token_ids``; it is
    extended lazily (only newly full blocks are hashed) whenever it is read.

    Raises:
        InvalidTokenCountError: empty prompt, an id outside ``0 .. 2**31 - 1`` or not an int,
            bad mm_hashes.
        InvalidRequestError: a request_id that is not a non-empty str, a prompt given as text
            (``str`` / ``bytes`` / ``bytearray``), a max_tokens or lora_id not None nor an int >= 0,
            a lora_name or cache_salt not None nor a str.
        HashBlockSizeMismatchError: a non-positive hash_block_size.
    """

    __slots__ = ("request_id", "num_prompt_tokens", "num_computed_tokens", "num_admissions", "lora_name", "lora_id", "cache_salt",
                 "mm_hashes", "max_tokens", "_retain", "_tokens", "_num_tokens", "_hash_block_size", "_block_hashes")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray, *,
                 hash_block_size: int | None = None, lora_name: str | None = None,
                 cache_salt: str | None = None, mm_hashes: Sequence[tuple[int, int, str]] | None = None,
                 max_tokens: int | None = None, lora_id: int | None = None,
                 retain: str | float | Retention | None = None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {type(request_id).__name__} "
                                      f"{request_id!r}")
        if isinstance(prompt_token_ids, (str, bytes, bytearray, memoryview)):
            raise InvalidRequestError(f"request {request_id!r}: prompt_token_ids must be token ids (ints), got "
                                      f"{type(prompt_token_ids).__name__}: tokenize the text first")
        if max_tokens is not None and (not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool)
                                       or max_tokens < 0):
            raise InvalidRequestError(f"request {request_id!r}: max_tokens must be None or an int >= 0, got {max_tokens!r}")
        if lora_id is not None and (not isinstance(lora_id, (int, np.integer)) or isinstance(lora_id, bool)
                                    or lora_id < 0):
            raise InvalidRequestError(f"request {request_id!r}: lora_id must be None or an int >= 0, got {lora_id!r}")
        for name, key in (("lora_name", lora_name), ("cache_salt", cache_salt)):
            if key is not None and not isinstance(key, str):
                raise InvalidRequestError(f"request {request_id!r}: {name} must be None or a str (it is part of "
                                          f"the block hashes), got {type(key).__name__} {key!r}")
        tokens = np.ascontiguousarray(as_token_array(prompt_token_ids))
        if tokens.size == 0:
            raise InvalidTokenCountError(f"request {request_id!r} has an empty prompt")
        if hash_block_size is not None and (not isinstance(hash_block_size, int) or hash_block_size <= 0):
            raise HashBlockSizeMismatchError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
        try:
            items = tuple((as_count(o, "mm_hashes offset"), as_count(n, "mm_hashes length"), str(h))
                          for o, n, h in (mm_hashes or ()))
        except (TypeError, ValueError) as e:
            if isinstance(e, InvalidTokenCountError):
                raise
            raise InvalidTokenCountError(f"mm_hashes must be (offset, length, hash) items: {e}") from None
        if any(o < 0 or n <= 0 for o, n, _ in items):
            raise InvalidTokenCountError(f"mm_hashes need offset >= 0 and length > 0, got {items}")
        beyond = [item for item in items if item[0] + item[1] > tokens.size]
        if beyond:
            raise InvalidTokenCountError(f"mm_hashes item {beyond[0]} ends past the {tokens.size}-token prompt")
        self.request_id = request_id
        self.num_prompt_tokens = int(tokens.size)
        self.num_computed_tokens = 0
        #: times a coordinator admitted it (allocated for it while it held no blocks); > 0 when
        #: it comes back after a preemption
        self.num_admissions = 0
        self.lora_name = lora_name
        self.lora_id = None if lora_id is None else int(lora_id)
        self.cache_salt = cache_salt
        self.mm_hashes = items
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self._retain = parse_retention(retain)
        self._tokens = tokens
        self._num_tokens = int(tokens.size)
        self._hash_block_size = hash_block_size
        self._block_hashes: list[bytes] = []

    # ------------------------------------------------------------------ retention
    @property
    def retain(self) -> Retention:
        """The retention hint of this request's cached prefix (:mod:`mambakv.core.retention`);
        read when the request is freed. Settable: ``"low"``, ``"normal"``, ``"high"``, a ttl in
        seconds, or None (normal); anything else raises InvalidRequestError."""
        return self._retain

    @retain.setter
    def retain(self, value: str | float | Retention | None) -> None:
        self._retain = parse_retention(value)

    # ------------------------------------------------------------------ tokens
    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return self._num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> np.ndarray:
        """All ids (prompt + output) as a read-only int32 view, length ``num_tokens``."""
        view = self._tokens[: self._num_tokens]
        view.flags.writeable = False
        return view

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens (one id or several, each in ``0 .. 2**31 - 1``). The buffer
        grows by doubling. Outputs exist only once the whole prompt was scheduled: the engine
        advances ``num_computed_tokens`` past the prompt before it appends the first output.

        Raises:
            InvalidTokenCountError: an id out of range or not an int, or the request is still in
                its prompt (``num_computed_tokens < num_prompt_tokens``); nothing is appended.
        """
        if self.num_computed_tokens < self.num_prompt_tokens:
            raise InvalidTokenCountError(
                f"request {self.request_id!r} is still in its prompt ({self.num_computed_tokens} of "
                f"{self.num_prompt_tokens} tokens computed): it has no output tokens yet")
        if type(token_ids) is list and len(token_ids) == 1:  # the decode step's one id: in place
            t, n = token_ids[0], self._num_tokens
            if type(t) is int and 0 <= t <= TOKEN_MAX and n < self._tokens.size:
                self._tokens[n] = t
                self._num_tokens = n + 1
                return
        if isinstance(token_ids, (int, np.integer)):
            token_ids = [token_ids]
        if isinstance(token_ids, list) and len(token_ids) <= 16:
            # A decode step appends a few ids: checking them in Python is cheaper than the
            # array.array + numpy round trip that a long list pays off.
            for t in token_ids:
                if not (isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t <= TOKEN_MAX):
                    raise InvalidTokenCountError(f"token ids must be ints in 0 .. {TOKEN_MAX}, got {t!r}")
            new: Sequence[int] | np.ndarray = token_ids
            num_new = len(token_ids)
        else:
            ids = as_token_array(token_ids)
            new, num_new = ids, ids.size
        need = self._num_tokens + num_new
        # Room past _num_tokens exists only in a buffer grown here (the prompt's array is exactly
        # full, and may be the caller's): so `need` within the size never writes a caller's array.
        if need > self._tokens.size:
            grown = np.empty(max(need, 2 * self._tokens.size), dtype=TOKEN_DTYPE)
            grown[: self._num_tokens] = self._tokens[: self._num_tokens]
            self._tokens = grown
        self._tokens[self._num_tokens : need] = new
        self._num_tokens = need

    # ------------------------------------------------------------------ hashes
    @property
    def hash_block_size(self) -> int | None:
        return self._hash_block_size

    def set_hash_block_size(self, hash_block_size: int) -> None:
        """Adopt a hash block size (the coordinator calls this on first use).

        Raises:
            HashBlockSizeMismatchError: the request already has a different one.
        """
        if self._hash_block_size is None:
            self._hash_block_size = hash_block_size
        elif self._hash_block_size != hash_block_size:
            raise HashBlockSizeMismatchError(
                f"request {self.request_id!r} hashes blocks of {self._hash_block_size} tokens, "
                f"the coordinator uses {hash_block_size}"
            )

    @property
    def block_hashes(self) -> list[bytes]:
        """Digests of every full hash block of ``all_token_ids`` (empty until the hash block
        size is known). Only blocks completed since the last read are hashed."""
        hbs = self._hash_block_size
        if hbs is None:
            return self._block_hashes
        done = len(self._block_hashes)
        full = self._num_tokens // hbs
        if full > done:
            parent = self._block_hashes[-1] if done else None
            extra = self._extra_keys(done, full, hbs)
            self._block_hashes.extend(hash_blocks(self._tokens, hbs, done, full, parent, extra))
        return self._block_hashes

    def _extra_keys(self, start: int, stop: int, hbs: int) -> list[bytes] | None:
        """Encoded extra keys of blocks ``[start, stop)``, or None when no block has any."""
        if self.lora_name is None and self.cache_salt is None and not self.mm_hashes:
            return None
        out = []
        for j in range(start, stop):
            lo, hi = j * hbs, (j + 1) * hbs
            keys: list[str] = []
            if self.lora_name is not None:
                keys.append("lora:" + self.lora_name)
            if j == 0 and self.cache_salt is not None:
                keys.append("salt:" + self.cache_salt)
            keys.extend("mm:" + h for o, n, h in self.mm_hashes if o < hi and o + n > lo)
            out.append(encode_extra_keys(tuple(keys)))
        return out

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, num_tokens={self._num_tokens}, computed={self.num_computed_tokens})"
