"""vLLM's KV-cache events: the server's own prefix cache as blocks, live (`--kv-events-config`).

vLLM publishes, over ZeroMQ, one message per engine step that changed its prefix cache: [topic, sequence number
(8 bytes, big-endian), payload], the payload a msgpack-encoded KVEventBatch [ts, events, data-parallel rank] whose
events are maps tagged by "type":
- BlockStored: block_hashes (a chain: each block's parent is the one before it; the first block's parent is
  parent_block_hash), token_ids (the tokens of all those blocks), block_size — full blocks whose KV just became
  reusable by a later prompt with the same prefix;
- BlockRemoved: block_hashes — evicted from the prefix cache (their memory reused);
- AllBlocksCleared — the cache was reset.
A hash is an int or bytes. With `"endpoint": "tcp://127.0.0.1:PORT"` vLLM's publisher connects to that address, so
the subscriber here binds it, on loopback; a replay endpoint (vLLM binds it) resends the batches from a sequence
number on, which is how a gap in the sequence (a subscriber that connected late, or a dropped message) is filled.

The pool (`BlockPool`) is what those events say: the blocks cached now, each with its parent, so a prefix two
prompts share is one chain with two branches, and what was stored and evicted. Bad messages (not msgpack, wrong
types, oversized, a flood) each get one line in `problems()`; the pool stays bounded (`max_blocks`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_MESSAGE = 8 << 20  # one batch; a step stores at most a few thousand blocks
MAX_BLOCKS = 1_000_000  # the pool's size cap: vLLM's CPU pool of 1 GiB for SmolLM2 is about 1,500 blocks of 16
MAX_TOKENS_KEPT = 64  # the first tokens of each block kept for its tooltip
MAX_PROBLEMS = 20


class KVEventError(ValueError):
    """A message could not be read; one sentence."""


def _key(h: object) -> str:
    """A block hash as text (vLLM's are ints or bytes)."""
    if isinstance(h, bool):
        raise KVEventError("a block hash is a boolean")
    if isinstance(h, int):
        return f"{h & (2**64 - 1):016x}" if h >= -(2**63) and h < 2**64 else f"{h:x}"
    if isinstance(h, (bytes, bytearray)) and len(h) <= 64:
        return bytes(h).hex()
    raise KVEventError(f"a block hash is {type(h).__name__}, not an int or bytes")


@dataclass(frozen=True)
class Block:
    key: str
    parent: str | None
    tokens: tuple[int, ...]  # its first MAX_TOKENS_KEPT token ids
    stored_seq: int  # the message that stored it


def decode(payload: bytes) -> tuple[float, list[dict]]:
    """A KVEventBatch's time and events (KVEventError, one sentence, when it is not one)."""
    import msgpack

    if len(payload) > MAX_MESSAGE:
        raise KVEventError(f"a KV-event message of {len(payload) >> 20} MB was dropped (over {MAX_MESSAGE >> 20} MB)")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)  # its sizes are bounded by the payload
    except (msgpack.UnpackException, ValueError, TypeError, RecursionError) as e:
        raise KVEventError(f"a KV-event message that is not msgpack was dropped ({type(e).__name__})") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KVEventError("a KV-event message that is not an event batch [ts, events, …] was dropped")
    ts = batch[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventError("a KV-event batch whose time is not a number was dropped")
    if not all(isinstance(e, dict) for e in batch[1]):
        raise KVEventError("a KV-event batch holding something that is not an event was dropped")
    return float(ts), batch[1]


class BlockPool:
    """The server's prefix cache as its KV events describe it."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[str, Block] = OrderedDict()
        self.stored = self.removed = self.cleared = 0  # events' blocks, since the start
        self.block_size: int | None = None
        self.last_seq = -1
        self._problems: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def problem(self, message: str) -> None:
        with self._lock:
            if message in self._problems or len(self._problems) < MAX_PROBLEMS:
                self._problems[message] = self._problems.get(message, 0) + 1

    def problems(self) -> list[str]:
        with self._lock:
            return [m if n == 1 else f"{m} (×{n})" for m, n in self._problems.items()]

    def __len__(self) -> int:
        return len(self.blocks)

    def apply(self, payload: bytes, seq: int = -1) -> None:
        """One message's events, in order; a bad message or event is one line in problems(), the rest applies."""
        try:
            _ts, events = decode(payload)
        except KVEventError as e:
            self.problem(str(e))
            return
        errors = []
        with self._lock:
            if seq >= 0:
                self.last_seq = max(self.last_seq, seq)
            for ev in events:
                try:
                    self._event(ev, seq)
                except KVEventError as e:
                    errors.append(str(e))
        for e in errors:
            self.problem(e)

    def _event(self, ev: dict, seq: int) -> None:
        kind = ev.get("type")
        if kind == "BlockStored":
            hashes, parent, tokens, size = (ev.get("block_hashes"), ev.get("parent_block_hash"), ev.get("token_ids"),
                                            ev.get("block_size"))
            if not isinstance(hashes, list) or not isinstance(tokens, list) or isinstance(size, bool) \
                    or not isinstance(size, int) or size <= 0:
                raise KVEventError("a BlockStored event without block hashes, token ids and a block size was skipped")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise KVEventError("a BlockStored event whose token ids are not integers was skipped")
            keys = [_key(h) for h in hashes]
            prev = None if parent is None else _key(parent)
            self.block_size = size
            for i, k in enumerate(keys):
                self.blocks.pop(k, None)
                self.blocks[k] = Block(k, prev, tuple(tokens[i * size:(i + 1) * size][:MAX_TOKENS_KEPT]), seq)
                prev = k
                self.stored += 1
            over = len(self.blocks) - self.max_blocks
            for _ in range(max(0, over)):
                self.blocks.popitem(last=False)
            if over > 0:
                raise KVEventError(f"more than {self.max_blocks} blocks stored: the oldest were dropped")
        elif kind == "BlockRemoved":
            hashes = ev.get("block_hashes")
            if not isinstance(hashes, list):
                raise KVEventError("a BlockRemoved event without block hashes was skipped")
            for h in hashes:
                if self.blocks.pop(_key(h), None) is not None:
                    self.removed += 1
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
            self.cleared += 1
        else:
            raise KVEventError(f"a KV event of type {str(kind)[:40]!r} was skipped")

    def chains(self) -> dict[str, list[str]]:
        """Each block's children (blocks whose parent it is): a prefix two prompts share branches where they part."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for b in self.blocks.values():
                if b.parent is not None:
                    out.setdefault(b.parent, []).append(b.key)
            return out

    def depth(self, key: str) -> int:
        """How many cached blocks lead to this one (0: its parent is not cached, or it has none)."""
        n, seen = 0, set()
        b = self.blocks.get(key)
        while b is not None and b.parent is not None and b.parent not in seen:
            seen.add(b.parent)
            b = self.blocks.get(b.parent)
            n += b is not None
        return n


MAX_SNAPSHOT = 20_000  # blocks a snapshot carries to the app (the newest)


@dataclass(frozen=True)
class BlockSnapshot:
    """The pool at one moment, as plain arrays for a view: blocks in chain order (each after its parent), `parent[i]`
    the index of block i's parent in this snapshot (−1: none cached), `sharers[i]` how many cached chain ends lie
    after it (2 or more: a prefix shared by that many sequences)."""

    n_blocks: int  # in the pool (the snapshot holds at most MAX_SNAPSHOT of them)
    parent: object  # np.ndarray int32
    sharers: object  # np.ndarray int32
    block_size: int | None
    stored: int
    removed: int
    cleared: int
    problems: tuple[str, ...] = ()


def snapshot(pool: BlockPool, limit: int = MAX_SNAPSHOT) -> BlockSnapshot:
    """The pool as a BlockSnapshot (its newest `limit` blocks)."""
    import numpy as np

    with pool._lock:
        blocks = list(pool.blocks.values())[-limit:]
        stats = (len(pool.blocks), pool.block_size, pool.stored, pool.removed, pool.cleared)
    index = {b.key: i for i, b in enumerate(blocks)}
    children: dict[int, list[int]] = {}
    parent = np.full(len(blocks), -1, dtype=np.int32)
    for i, b in enumerate(blocks):
        if b.parent is not None and b.parent in index:
            parent[i] = index[b.parent]
            children.setdefault(int(parent[i]), []).append(i)
    order: list[int] = []  # depth-first from each root: a chain's blocks side by side
    for root in (i for i in range(len(blocks)) if parent[i] < 0):
        stack = [root]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(children.get(i, [])))
    sharers = np.zeros(len(blocks), dtype=np.int32)
    for i in reversed(order):  # children come after their parent in `order`
        sharers[i] = max(1, int(sum(sharers[c] for c in children.get(i, []))))
    at = np.asarray(order, dtype=np.int64)
    pos = np.empty(len(blocks), dtype=np.int64)
    pos[at] = np.arange(len(at))  # where each block sits in chain order
    old = parent[at]
    new_parent = np.where(old >= 0, pos[np.maximum(old, 0)], -1).astype(np.int32)
    return BlockSnapshot(n_blocks=stats[0], parent=new_parent, sharers=sharers[at], block_size=stats[1],
                         stored=stats[2], removed=stats[3], cleared=stats[4], problems=tuple(pool.problems()))


_SUBSCRIBERS: dict[int, KVEventSubscriber] = {}
_SUBSCRIBERS_LOCK = threading.Lock()


def subscriber_on(port: int, replay_port: int | None = None) -> KVEventSubscriber:
    """This process's subscriber bound at tcp://127.0.0.1:`port`, started at the first call and kept for the
    process's life (a vLLM started with that endpoint connects whenever it runs). KVEventError, one sentence, when
    the port cannot be had."""
    import zmq

    if not 1 <= port <= 65535 or (replay_port is not None and not 1 <= replay_port <= 65535):
        raise KVEventError("the KV-event ports must be between 1 and 65535")
    with _SUBSCRIBERS_LOCK:
        sub = _SUBSCRIBERS.get(port)
        if sub is None:
            replay = f"tcp://127.0.0.1:{replay_port}" if replay_port else None
            try:
                sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", replay).start()
            except zmq.ZMQError as e:
                raise KVEventError(f"the KV-event subscriber cannot listen on 127.0.0.1:{port}: {e}") from None
            _SUBSCRIBERS[port] = sub
        return sub


class KVEventSubscriber:
    """Subscribes to a vLLM's KV events: binds `endpoint` (tcp://127.0.0.1:PORT, which vLLM's publisher connects to),
    applies each message to `pool`, and asks `replay_endpoint` (vLLM's, when given) for what a gap in the sequence
    numbers missed. `start()` / `stop()`, or `with`."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 pool: BlockPool | None = None) -> None:
        import zmq

        if not endpoint.startswith("tcp://127.0.0.1:"):
            raise KVEventError(f"the KV-event subscriber listens on loopback (tcp://127.0.0.1:PORT), not {endpoint!r}")
        self.pool = pool if pool is not None else BlockPool()
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.messages = 0
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)  # a bigger message drops its connection
        self._sub.setsockopt(zmq.RCVHWM, 10_000)  # past it, messages are dropped (a flood), and a gap is seen
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.bind(endpoint)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition()

    def start(self) -> KVEventSubscriber:
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sub.close(0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait(self, predicate, timeout_s: float) -> bool:
        """Wait until predicate(pool) holds (True) or `timeout_s` passes (False)."""
        import time

        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self.pool):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.2))
            return True

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            self._message(frames)

    def _message(self, frames: list[bytes], replaying: bool = False) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.pool.problem("a KV-event message that is not [topic, sequence, payload] was dropped")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if not replaying and self.pool.last_seq >= 0 and seq > self.pool.last_seq + 1:
            missed = seq - self.pool.last_seq - 1
            if not self._replay(self.pool.last_seq + 1, seq):
                self.pool.problem(f"{missed} KV-event message(s) were missed and could not be replayed: the block "
                                  "view may be incomplete")
        if replaying or seq > self.pool.last_seq:
            self.pool.apply(frames[2], seq)
        self.messages += 1
        with self._changed:
            self._changed.notify_all()

    def _replay(self, start: int, until: int) -> bool:
        """Ask vLLM's replay endpoint for messages start … until−1; True when it answered to the end."""
        import zmq

        if not self.replay_endpoint:
            return False
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        s.setsockopt(zmq.RCVTIMEO, 2000)
        try:
            s.connect(self.replay_endpoint)
            s.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(until - start + 10_000):  # bounded: vLLM ends with sequence −1
                frames = s.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and frames[1] == (-1).to_bytes(8, "big", signed=True):
                    return True
                if len(frames) == 3 and int.from_bytes(frames[1], "big", signed=True) < until:
                    self._message(frames, replaying=True)
            return False
        except zmq.ZMQError:
            return False
        finally:
            s.close(0)


def kv_events_config(endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> dict:
    """vLLM's --kv-events-config for a subscriber bound at `endpoint` (vLLM connects to it)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}
    if replay_endpoint:
        cfg["replay_endpoint"] = replay_endpoint
    return cfg
