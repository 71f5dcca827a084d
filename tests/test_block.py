"""FreeBlockQueue links and KVCacheBlock identity (DESIGN.md section 3, mambakv/block.py)."""

from __future__ import annotations

import pytest

from mambakv import BlockNotFreeError, FreeBlockQueue, KVCacheBlock, MambaKVError, OutOfBlocksError


def make(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def assert_links(q: FreeBlockQueue, expected: list[KVCacheBlock], outside: list[KVCacheBlock] = ()) -> None:
    """Check every pointer explicitly: head <-> expected[0] <-> ... <-> expected[-1] <-> tail,
    and blocks in `outside` fully unlinked. Then the queue's own check_invariants."""
    head, tail = q.sentinels
    chain = [head, *expected, tail]
    assert head.prev_free_block is None and tail.next_free_block is None
    assert head.block_id == -1 and tail.block_id == -1
    for left, right in zip(chain, chain[1:]):
        assert left.next_free_block is right, f"{left.block_id}.next is not {right.block_id}"
        assert right.prev_free_block is left, f"{right.block_id}.prev is not {left.block_id}"
    for b in outside:
        assert b.prev_free_block is None and b.next_free_block is None, f"block {b.block_id} still linked"
    assert q.num_free_blocks == len(expected)
    assert q.get_all_free_blocks() == expected
    assert all(b.block_id >= 0 for b in q.get_all_free_blocks()), "sentinel returned"
    q.check_invariants()


def test_construction_queues_in_list_order():
    blocks = make(5)
    q = FreeBlockQueue(blocks)
    assert_links(q, blocks)


def test_empty_queue():
    q = FreeBlockQueue([])
    assert_links(q, [])
    with pytest.raises(OutOfBlocksError):
        q.popleft()
    assert_links(q, [])
    assert q.popleft_n(0) == []
    with pytest.raises(OutOfBlocksError):
        q.popleft_n(1)
    assert_links(q, [])


def test_popleft_until_empty_never_returns_sentinel():
    blocks = make(3)
    q = FreeBlockQueue(blocks)
    got = []
    for k in range(3):
        got.append(q.popleft())
        assert_links(q, blocks[k + 1 :], outside=got)
    assert got == blocks
    with pytest.raises(OutOfBlocksError) as e:
        q.popleft()
    assert isinstance(e.value, MambaKVError)
    assert_links(q, [], outside=blocks)
    # the queue still works after running dry
    q.append(blocks[1])
    assert_links(q, [blocks[1]], outside=[blocks[0], blocks[2]])


def test_remove_head_middle_tail():
    b = make(5)
    q = FreeBlockQueue(b)
    q.remove(b[2])  # middle
    assert_links(q, [b[0], b[1], b[3], b[4]], outside=[b[2]])
    q.remove(b[0])  # head
    assert_links(q, [b[1], b[3], b[4]], outside=[b[0], b[2]])
    q.remove(b[4])  # tail
    assert_links(q, [b[1], b[3]], outside=[b[0], b[2], b[4]])
    q.remove(b[1])
    q.remove(b[3])
    assert_links(q, [], outside=b)


def test_remove_block_not_in_queue_raises_and_changes_nothing():
    b = make(4)
    q = FreeBlockQueue(b[:3])
    with pytest.raises(BlockNotFreeError) as e:
        q.remove(b[3])  # never queued
    assert isinstance(e.value, MambaKVError)
    assert_links(q, b[:3], outside=[b[3]])
    q.remove(b[1])
    with pytest.raises(BlockNotFreeError):
        q.remove(b[1])  # already removed
    assert_links(q, [b[0], b[2]], outside=[b[1], b[3]])
    popped = q.popleft()
    with pytest.raises(BlockNotFreeError):
        q.remove(popped)
    assert_links(q, [b[2]], outside=[b[0], b[1], b[3]])
    # the sentinels are not removable blocks either
    with pytest.raises(BlockNotFreeError):
        q.remove(q.sentinels[0])
    with pytest.raises(BlockNotFreeError):
        q.remove(q.sentinels[1])
    assert_links(q, [b[2]])


def test_append_and_popleft_fifo():
    b = make(4)
    q = FreeBlockQueue([])
    for k in range(4):
        q.append(b[k])
        assert_links(q, b[: k + 1])
    q.remove(b[1])
    q.append(b[1])  # revived and freed again: now at the tail
    assert_links(q, [b[0], b[2], b[3], b[1]])
    assert q.popleft() is b[0]
    assert_links(q, [b[2], b[3], b[1]], outside=[b[0]])


def test_popleft_n_keeps_order_and_unlinks():
    b = make(6)
    q = FreeBlockQueue(b)
    got = q.popleft_n(4)
    assert got == b[:4]
    assert_links(q, b[4:], outside=got)
    assert q.popleft_n(2) == b[4:]  # exactly all that is left
    assert_links(q, [], outside=b)


def test_popleft_n_beyond_count_raises_and_changes_nothing():
    b = make(5)
    q = FreeBlockQueue(b)
    q.remove(b[2])
    with pytest.raises(OutOfBlocksError) as e:
        q.popleft_n(5)  # 4 free
    assert isinstance(e.value, MambaKVError)
    assert_links(q, [b[0], b[1], b[3], b[4]], outside=[b[2]])
    assert q.popleft_n(0) == []
    assert_links(q, [b[0], b[1], b[3], b[4]], outside=[b[2]])


def test_append_n_and_prepend_n_keep_order():
    b = make(8)
    q = FreeBlockQueue(b[2:4])  # 2 3
    q.append_n([b[5], b[4]])  # 2 3 5 4
    assert_links(q, [b[2], b[3], b[5], b[4]])
    q.prepend_n([b[1], b[0]])  # 1 0 2 3 5 4: blocks[0] of the call is reused first
    assert_links(q, [b[1], b[0], b[2], b[3], b[5], b[4]])
    q.append_n([])
    q.prepend_n([])
    assert_links(q, [b[1], b[0], b[2], b[3], b[5], b[4]], outside=[b[6], b[7]])
    assert q.popleft_n(3) == [b[1], b[0], b[2]]
    assert_links(q, [b[3], b[5], b[4]], outside=[b[0], b[1], b[2]])


def test_bulk_ops_on_empty_queue():
    b = make(4)
    q = FreeBlockQueue([])
    q.prepend_n([b[0], b[1]])
    assert_links(q, [b[0], b[1]])
    q.popleft_n(2)
    q.append_n(iter([b[2], b[3]]))  # any iterable
    assert_links(q, [b[2], b[3]], outside=[b[0], b[1]])


def test_mixed_sequence_keeps_links():
    """A longer scripted sequence; the expected list is maintained independently."""
    b = make(10)
    q = FreeBlockQueue(b[:6])
    model = list(b[:6])
    script = [
        ("remove", 3), ("popleft",), ("append", 3), ("popleft_n", 2), ("prepend_n", [0, 1]),
        ("append_n", [6, 7, 8]), ("remove", 8), ("remove", 0), ("popleft_n", 3), ("prepend_n", [9]),
        ("append", 0),
    ]
    for op, *arg in script:
        if op == "remove":
            q.remove(b[arg[0]])
            model.remove(b[arg[0]])
        elif op == "popleft":
            assert q.popleft() is model.pop(0)
        elif op == "popleft_n":
            n = arg[0]
            assert q.popleft_n(n) == model[:n]
            del model[:n]
        elif op == "append":
            q.append(b[arg[0]])
            model.append(b[arg[0]])
        elif op == "append_n":
            q.append_n([b[i] for i in arg[0]])
            model.extend(b[i] for i in arg[0])
        elif op == "prepend_n":
            model[:0] = [b[i] for i in arg[0]]
            q.prepend_n([b[i] for i in arg[0]])
        assert_links(q, model, outside=[x for x in b if x not in model])
    # 10 blocks, by hand: start 0..5; remove 3 -> 0 1 2 4 5; popleft 0 -> 1 2 4 5; append 3 -> 1 2 4 5 3;
    # popleft_n 2 -> 4 5 3; prepend 0 1 -> 0 1 4 5 3; append 6 7 8 -> 0 1 4 5 3 6 7 8; remove 8, 0 ->
    # 1 4 5 3 6 7; popleft_n 3 -> 3 6 7; prepend 9 -> 9 3 6 7; append 0 -> 9 3 6 7 0
    assert ids(q.get_all_free_blocks()) == [9, 3, 6, 7, 0]


# ---------------------------------------------------------------------- KVCacheBlock


def test_block_fields():
    blk = KVCacheBlock(7)
    assert (blk.block_id, blk.ref_cnt, blk.block_hash, blk.is_null) == (7, 0, None, False)
    assert blk.prev_free_block is None and blk.next_free_block is None


def test_block_compares_by_identity():
    a, b = KVCacheBlock(3), KVCacheBlock(3)
    a.block_hash = b.block_hash = b"x" * 16
    assert a is not b
    assert a != b
    assert not (a == b)
    assert a == a
    assert len({a, b}) == 2
    lst = [a, b]
    lst.remove(b)  # must remove b itself, not the first field-equal block
    assert lst[0] is a and len(lst) == 1
    assert b not in [a]


def test_block_has_slots():
    blk = KVCacheBlock(1)
    assert hasattr(KVCacheBlock, "__slots__")
    assert not hasattr(blk, "__dict__")
    with pytest.raises(AttributeError):
        blk.some_new_field = 1
