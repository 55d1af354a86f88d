"""vLLM's KV-cache events into the block pool (engine.remote.kvevents). The reference sender is vLLM's own publisher
(vllm.distributed.kv_events.ZmqEventPublisher with its KVEventBatch, in vLLM's virtual environment): the pool must
hold exactly the blocks its events stored and not removed, with their parents; a gap is filled from its replay
endpoint. Then hostile messages from a plain ZeroMQ publisher: each one line, the pool bounded, the subscriber alive."""

from __future__ import annotations

import subprocess
import textwrap
import time

import msgpack
import zmq

from engine.remote.kvevents import BlockPool, KVEventSubscriber
from engine.remote.launch import VLLM_PY, free_port
from tests.requires import missing

# the blocks, by hand: two prompts sharing a 2-block prefix (1 → 2), then 3 and 4 after it; 5 alone; 1 evicted… no:
# 5 is evicted, then a whole reset is not sent (the pool would be empty)
PUBLISH = textwrap.dedent("""
    import sys, time
    from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                            ZmqEventPublisher)
    pub = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2], topic="kv")
    time.sleep(1.5)  # the subscriber's connection settles (a PUB drops what it sends before)
    def stored(hashes, parent, tokens):
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4,
                           lora_id=None, medium="CPU", lora_name=None)
    batches = [
        [stored([11, 12], None, list(range(8)))],
        [stored([13], 12, [8, 9, 10, 11]), stored([b"\\x05" * 8], None, [1, 1, 1, 1])],
        [stored([14], 12, [20, 21, 22, 23])],
        [BlockRemoved(block_hashes=[b"\\x05" * 8], medium="CPU")],
    ]
    if sys.argv[3] == "clear":
        batches.append([AllBlocksCleared()])
    for i, events in enumerate(batches):
        if sys.argv[3] == "gap" and i == 1:
            pub._seq += 0  # published normally: the subscriber drops it on purpose (see the test)
        pub.publish(KVEventBatch(ts=time.time(), events=events))
        time.sleep(0.3)
    time.sleep(float(sys.argv[4]))  # keep the replay endpoint up for a subscriber that asks
    pub.shutdown()
""")


def vllm_publish(endpoint: str, replay: str, mode: str = "", linger_s: float = 1.0) -> subprocess.Popen:
    if not VLLM_PY.exists():
        missing("servers", f"vLLM's virtual environment is missing ({VLLM_PY})")
    return subprocess.Popen([str(VLLM_PY), "-c", PUBLISH, endpoint, replay, mode or "-", str(linger_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def key(h) -> str:
    return f"{h:016x}" if isinstance(h, int) else h.hex()


def test_vllms_own_publisher_fills_the_pool(tmp_path):
    ep, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with KVEventSubscriber(ep, replay, topic="kv") as sub:
        p = vllm_publish(ep, replay)
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, out[-2000:]
        assert sub.wait(lambda pool: pool.stored == 5 and pool.removed == 1, 10)
        pool = sub.pool
        # by hand: 11 → 12 → {13, 14}; 0x05… stored then removed
        assert set(pool.blocks) == {key(11), key(12), key(13), key(14)}
        assert pool.blocks[key(11)].parent is None and pool.blocks[key(12)].parent == key(11)
        assert pool.blocks[key(13)].parent == key(12) and pool.blocks[key(14)].parent == key(12)
        assert pool.chains()[key(12)] == [key(13), key(14)]  # the shared prefix branches here
        assert pool.blocks[key(12)].tokens == (4, 5, 6, 7) and pool.depth(key(14)) == 2
        assert pool.block_size == 4 and pool.problems() == []


def test_a_gap_is_filled_from_vllms_replay_endpoint():
    """The subscriber misses message 1 (dropped here on purpose); seeing message 2 it asks the replay endpoint."""
    ep, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with KVEventSubscriber(ep, replay, topic="kv") as sub:
        real = sub._message
        dropped = []

        def lossy(frames, replaying=False):
            seq = int.from_bytes(frames[1], "big", signed=True) if len(frames) == 3 else None
            if seq == 1 and not replaying and not dropped:
                dropped.append(seq)
                return
            real(frames, replaying)

        sub._message = lossy
        p = vllm_publish(ep, replay, linger_s=3.0)
        assert sub.wait(lambda pool: pool.stored == 5 and pool.removed == 1, 60)
        p.communicate(timeout=120)
        assert dropped == [1] and key(13) in sub.pool.blocks and sub.pool.problems() == []


def test_hostile_messages_each_get_one_line_and_the_pool_stays_bounded():
    ep = f"tcp://127.0.0.1:{free_port()}"
    pool = BlockPool(max_blocks=50)
    with KVEventSubscriber(ep, pool=pool) as sub:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.connect(ep)
        time.sleep(1.0)

        def send(seq: int, payload: bytes, frames: list[bytes] | None = None) -> None:
            pub.send_multipart(frames or [b"", seq.to_bytes(8, "big"), payload])

        good = [time.time(), [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                               "token_ids": [1, 2, 3, 4], "block_size": 2}]]
        send(0, msgpack.packb(good))
        send(1, b"\xc1\xc1 not msgpack")
        send(2, msgpack.packb({"ts": 1}))
        send(3, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x", "token_ids": [],
                                      "block_size": 2}]]))
        send(4, msgpack.packb([1.0, [{"type": "Teleported"}]]))
        send(5, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [3.5], "parent_block_hash": None,
                                      "token_ids": [1, 2], "block_size": 2}]]))
        send(6, b"", [b"only", b"two"])
        assert sub.wait(lambda p: len(p.problems()) >= 6, 30)
        send(7, b"\x00" * (9 << 20))  # over the 8 MB a message may be: ZeroMQ drops it with its connection
        time.sleep(1.0)
        pub.close(0)
        pub = ctx.socket(zmq.PUB)  # a new connection for the flood
        pub.connect(ep)
        time.sleep(1.0)
        for i in range(200):  # a flood: 200 batches of 10 new blocks each, on a pool of at most 50
            send(100 + i, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": list(range(1000 + 10 * i,
                                                                                                  1010 + 10 * i)),
                                                "parent_block_hash": None, "token_ids": list(range(20)),
                                                "block_size": 2}]]))
        assert sub.wait(lambda p: p.stored >= 2 + 2000 * 0.5, 30)
        pub.close(0)
        problems = pool.problems()
        for words in ("not msgpack", "not an event batch", "without block hashes", "'Teleported'",
                      "a block hash is float", "not [topic, sequence, payload]", "oldest were dropped"):
            assert sum(words in m for m in problems) == 1, (words, problems)
        assert len(pool) <= 50 and all("\n" not in m for m in problems)
        assert any("missed and could not be replayed" in m for m in problems)  # no replay endpoint was given


def test_a_snapshot_orders_chains_and_counts_sharers_by_hand():
    from engine.remote.kvevents import snapshot

    pool = BlockPool()

    def stored(hashes, parent):
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": [0] * (4 * len(hashes)), "block_size": 4}

    # stored in this order: 9 alone; 1 → 2; 3 after 2; 4 after 2; 5 after 4
    pool.apply(msgpack.packb([1.0, [stored([9], None), stored([1, 2], None), stored([3], 2), stored([4], 2),
                                    stored([5], 4)]]))
    s = snapshot(pool)
    # chain order by hand: 9 | 1 2 3 4 5 (a root, then depth first in the order stored)
    assert s.parent.tolist() == [-1, -1, 1, 2, 2, 4]
    # sequences through each: 9 one; 1 and 2 two (3 and 5 end there); 3 one; 4 one; 5 one
    assert s.sharers.tolist() == [1, 2, 2, 1, 1, 1]
    assert (s.n_blocks, s.block_size, s.stored) == (6, 4, 6)
    newest = snapshot(pool, limit=2)  # the newest two: 4 → 5, one sequence through both (4's parent not drawn)
    assert newest.parent.tolist() == [-1, 0] and newest.sharers.tolist() == [1, 1] and newest.n_blocks == 6
