"""KV events (engine/kvcache/kv_events.py, event_publisher.py): what the prefix cache stores
and removes, tier by tier, in vLLM's message shape. The contract test decodes every batch with
the consumer's schema (tests/support/vllm_kv_events.py) and rebuilds the cache from the events
alone: it must equal the cache, device and host tier, after every step of random traffic and
after a real engine's requests, evictions and loads."""

from __future__ import annotations

import random
import socket

import msgspec
import pytest
import zmq
from prefix_cache_support import make_env, random_step
from vllm_kv_events import AllBlocksCleared, BlockStored, Index, KVEventBatch, decode_batch

from tandem.engine.kvcache.kv_events import DEVICE, HOST, KVEventsConfig, block_hashes


def _tree_state(cache) -> dict[str, set[int]]:
    """The block hashes each tier of a radix cache holds, walked from the tree."""
    out: dict[str, set[int]] = {DEVICE: set(), HOST: set()}
    for node in cache._nodes():
        if node.slots is not None:
            out[DEVICE] |= set(node.hashes)
        if node.host is not None:
            out[HOST] |= set(node.hashes)
    return out


def test_a_blocks_hash_names_its_whole_prefix() -> None:
    a = block_hashes(None, list(range(8)), 4)
    assert a == block_hashes(None, list(range(8)), 4) and len(a) == 2 and len(set(a)) == 2
    assert block_hashes(a[0], list(range(4, 8)), 4) == a[1:]  # chained: the parent carries the prefix
    assert block_hashes(None, [9, 9, 9, 9] + list(range(4, 8)), 4)[1] != a[1]  # same tokens, other prefix
    assert block_hashes(None, list(range(6)), 4) == a[:1]  # a partial block has no hash
    assert all(0 <= h < 2**63 for h in a)


def test_the_config_is_vllms_json_and_bad_json_is_refused() -> None:
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                               '"topic": "kv"}')
    assert cfg.enabled and cfg.topic == "kv" and not KVEventsConfig.parse(None).enabled
    for bad, match in (("{", "not JSON"), ("[]", "JSON object"), ('{"endpoint_x": 1}', "unknown keys"),
                       ('{"publisher": "kafka"}', "publisher zmq or null"),
                       ('{"buffer_steps": 0}', "buffer_steps must be an integer"),
                       ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "udp://x"}', "tcp://")):
        with pytest.raises(ValueError, match=match):
            KVEventsConfig.parse(bad)


@pytest.mark.parametrize("kind", ["radix", "tiered"])
def test_the_events_rebuild_the_cache_after_every_step(kind: str) -> None:
    """Random traffic over shared prefixes; after each step the step's batch, encoded as it
    goes on the wire and decoded with the consumer's schema, brings an index built from the
    events alone to the tree's own state, in each tier."""
    rng = random.Random(3)
    env = make_env(kind, 2, num_pages=24, host_pages=10, events=True)
    log = env.cache.events
    index, encode = Index(), msgspec.msgpack.Encoder().encode
    seen = {DEVICE: 0, HOST: 0}  # the most blocks each tier held at once: the check is not of two empty sets
    for step in range(250):
        random_step(env, rng, reset=True)
        batch = log.drain(dp_rank=0)
        if batch is not None:
            index.apply(decode_batch(encode(batch)))
        state = _tree_state(env.cache)
        assert index.hashes(DEVICE) == state[DEVICE], step
        assert index.hashes(HOST) == state[HOST], step
        seen = {m: max(seen[m], len(state[m])) for m in seen}
        env.check()
    assert seen[DEVICE] >= 8 and (kind == "radix" or seen[HOST] >= 4), seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_engine_publishes_what_a_vllm_subscriber_reads(engine) -> None:
    """A real engine on a small pool with a host tier. A subscriber written for vLLM asks for a
    replay from seq 0 (what a subscriber that joined late does: PUB drops what was sent before
    its subscription arrived), decodes every batch, in order, and its index matches the cache,
    device and host; the live stream then carries the next batches, a flush's AllBlocksCleared."""
    port, replay = _free_port(), _free_port()
    cfg = (f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{port}", '
           f'"replay_endpoint": "tcp://127.0.0.1:{replay}", "topic": "kv"}}')
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind(f"tcp://127.0.0.1:{port}")  # the engine's endpoint has no "*": it connects to us
    eng = engine(max_total_tokens=96, page_size=4, disable_overlap_schedule=True, kv_events_config=cfg,
                 enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_back")
    prompts = [list(range(200 + 40 * i, 230 + 40 * i)) for i in range(5)]  # 5 x 30 tokens through 96
    for p in prompts + prompts[:2]:  # the first two again: loaded back from the host tier
        eng.generate([p], {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    status = eng.status()[0].info  # a round trip: the step that ran the last request has published
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{replay}")
    req.send_multipart((b"garbage",))  # not a replay request: ignored, the publisher goes on
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    seqs, got = [], []
    while req.poll(5000):
        _, seq_bytes, payload = req.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == -1:
            break
        seqs.append(seq)
        got.append(payload)
    assert seqs and seqs == list(range(len(seqs))), seqs
    index = Index()
    for payload in got:
        index.apply(decode_batch(payload))
    state = _tree_state(eng.scheduler.cache.tree)
    assert index.hashes(DEVICE) == state[DEVICE] and index.hashes(HOST) == state[HOST]
    assert status["host_tier"]["loaded_tokens"] > 0 and index.hashes(HOST)
    stored = [ev for p in got for ev in decode_batch(p).events if isinstance(ev, BlockStored)]
    first = next(ev for ev in stored if ev.token_ids[:4] == prompts[0][:4])
    assert first.parent_block_hash is None and first.block_size == 4 and first.medium == DEVICE
    # Live: each flush publishes one AllBlocksCleared batch; the subscription is up within a few.
    live = None
    for _ in range(10):
        eng.flush_cache()
        eng.status()
        if sub.poll(1000):
            live = sub.recv_multipart()
            break
    assert live is not None and live[0] == b"kv" and int.from_bytes(live[1], "big") >= len(seqs)
    batch = decode_batch(live[2])
    assert isinstance(batch, KVEventBatch) and isinstance(batch.events[-1], AllBlocksCleared)
    assert batch.data_parallel_rank == 0
    sub.close()
    req.close()


def test_events_need_the_radix_cache(engine) -> None:
    with pytest.raises(ValueError, match="KV events describe the radix cache"):
        engine(disable_radix_cache=True, kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq"}')


def test_a_bad_endpoint_fails_the_start(engine) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        cfg = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
               f'"endpoint": "tcp://*:{busy.getsockname()[1]}"}}')
        with pytest.raises(Exception, match="kv_events_config: cannot open"):
            engine(kv_events_config=cfg)
    finally:
        busy.close()
