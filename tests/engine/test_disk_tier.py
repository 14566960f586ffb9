"""The disk tier (engine/kvcache/disk_tier.py): pages the host tier holds are backed up in files
named by their block hash; a match past the host tier, or a worker restarted on the same model,
loads them. A file is checked before it is loaded (name, magic, header, identity, parent, tokens,
length, CRC): a corrupt or truncated one is deleted and the page recomputed, never loaded, and a
writer killed mid-write leaves only a temporary the next start deletes."""

from __future__ import annotations

from pathlib import Path

import pytest
from smoke import full_only

from tandem.engine.kvcache.disk_tier import DiskTier

PAGE = 64


def _tier(root: Path, budget: int = 100 * PAGE, identity: str = "m-1") -> DiskTier:
    return DiskTier(root, identity, budget, PAGE)


def _written(tier: DiskTier) -> DiskTier:
    """Every queued page written (the writer stops); a fresh tier over the same directory."""
    tier.close()
    return _tier(tier.dir.parent, tier.budget, tier.identity)


def test_a_page_comes_back_as_written_and_survives_a_restart(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put(7, None, [1, 2, 3, 4], bytes(range(PAGE)))
    tier.put(9, 7, [5, 6, 7, 8], b"\x01" * PAGE)
    again = _written(tier)  # a restarted worker scans the directory
    assert again.has(7) and again.has(9) and again.used_bytes() > 2 * PAGE
    assert again.get(7, None, [1, 2, 3, 4]) == bytes(range(PAGE))
    assert again.get(9, 7, [5, 6, 7, 8]) == b"\x01" * PAGE
    assert again.stats.loaded_pages == 2 and tier.stats.written_pages == 2
    assert _tier(tmp_path, identity="another-model").get(7, None, [1, 2, 3, 4]) is None  # its own directory
    again.close()


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "empty", "other tokens", "other parent",
                                    "garbage header"])
def test_a_damaged_page_is_deleted_never_loaded(tmp_path: Path, damage: str) -> None:
    tier = _tier(tmp_path)
    tier.put(7, 3, [1, 2, 3, 4], bytes(range(PAGE)))
    tier = _written(tier)
    path = tier.dir / f"{7:016x}.kv"
    data = bytearray(path.read_bytes())
    tokens, parent = [1, 2, 3, 4], 3
    if damage == "flip a payload byte":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage == "other tokens":
        tokens = [1, 2, 3, 5]  # what a hash collision would look like
    elif damage == "other parent":
        parent = 4
    else:
        data[12:40] = b"{" * 28
    path.write_bytes(bytes(data))
    assert tier.get(7, parent, tokens) is None
    assert not path.exists() and not tier.has(7) and tier.stats.rejected_pages == 1
    tier.close()


def test_a_writer_killed_mid_write_leaves_nothing_that_loads(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.put(7, None, [1, 2, 3, 4], bytes(range(PAGE)))
    tier = _written(tier)
    good = tier.dir / f"{7:016x}.kv"
    (tier.dir / f"{8:016x}.kv.1234.tmp").write_bytes(good.read_bytes()[:50])  # a kill before the rename
    (tier.dir / f"{9:016x}.kv").write_bytes(good.read_bytes()[:50])  # torn by something else
    (tier.dir / "notes.txt").write_text("not ours")
    tier.close()
    again = _tier(tmp_path)
    assert not list(again.dir.glob("*.tmp"))  # the temporary is gone at start
    assert again.get(9, None, [1, 2, 3, 4]) is None and again.stats.rejected_pages == 1
    assert again.get(7, None, [1, 2, 3, 4]) == bytes(range(PAGE))
    again.close()


def test_the_budget_drops_the_least_recently_used(tmp_path: Path) -> None:
    probe = _tier(tmp_path / "probe")
    probe.put(1, None, [1], b"\x00" * PAGE)
    size = _written(probe).used_bytes()  # one page's file, header and checksum included
    tier = _tier(tmp_path, budget=3 * size)
    for h in range(1, 4):
        tier.put(h, None, [h], b"\x00" * PAGE)
    tier = _written(tier)
    assert tier.get(1, None, [1]) is not None  # page 1 is now the most recent
    tier.put(4, None, [4], b"\x00" * PAGE)
    tier = _written(tier)
    assert tier.has(1) and tier.has(4) and not tier.has(2) and tier.used_bytes() <= 3 * size
    tier.close()


def test_a_budget_below_one_page_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds not one page"):
        DiskTier(tmp_path, "m", PAGE - 1, PAGE)


# ---- in the engine -------------------------------------------------------------------------

SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = [list(range(300 + 50 * i, 340 + 50 * i)) for i in range(8)]  # 8 x 40 tokens


def _answers(eng, prompts=PROMPTS) -> tuple[list[list[int]], list[int]]:
    outs = [eng.generate([p], SP)[0] for p in prompts]
    return [o["token_ids"] for o in outs], [o["meta"]["cached_tokens"] for o in outs]


def _tiered(engine, disk: Path, **kw):
    return engine(max_total_tokens=96, page_size=4, disable_overlap_schedule=True, enable_hierarchical_cache=True,
                  hicache_ratio=1.0, hicache_storage_backend="file", hicache_storage_dir=str(disk), **kw)


def test_the_engine_answers_alike_reading_pages_back_from_disk(engine, tmp_path: Path) -> None:
    """A device pool of 96 tokens and a host tier as small: the second pass over 8 prompts of 40
    finds most of them on disk only, loads them, and answers as a worker with no tiers does."""
    want, _ = _answers(engine(max_total_tokens=96, page_size=4, disable_overlap_schedule=True))
    eng = _tiered(engine, tmp_path)
    first, _ = _answers(eng)
    eng.scheduler.disk.flush()  # the writer drains: every page the host took is on disk
    second, cached = _answers(eng)
    assert first == want and second == want
    assert sum(cached) >= 8 * 36 and eng.scheduler.disk.stats.loaded_pages > 0, cached


def test_a_restarted_worker_warms_from_disk_and_skips_a_corrupt_page(engine, tmp_path: Path) -> None:
    a = _tiered(engine, tmp_path)
    want, _ = _answers(a)
    a.shutdown()  # closes the writer: what the host held is on disk
    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    data = bytearray(files[0].read_bytes())
    data[-8] ^= 0xFF  # one page's payload damaged on disk
    files[0].write_bytes(bytes(data))
    b = _tiered(engine, tmp_path)
    got, cached = _answers(b)
    assert got == want
    disk = b.status()[0].info["disk_tier"]
    assert disk["rejected_pages"] == 1 and disk["loaded_pages"] > 0, disk
    assert sum(cached) > 0  # a cold worker, and still prompts hit: from the disk


@full_only("the single-rank disk tier cases; tests/engine/test_host_tier_engine.py keeps TP ranks' tiers in step")
def test_tensor_parallel_ranks_load_alike_when_one_rank_loses_a_page(engine, tmp_path: Path) -> None:
    """At TP 2 each rank keeps its own files (its KV heads); a page damaged on rank 1's disk only
    is loaded by neither rank (they agree on the smallest run their disks hold: the batch digest
    would catch ranks that scheduled apart), and the answers are a single rank's."""
    want, _ = _answers(engine(max_total_tokens=96, page_size=4, disable_overlap_schedule=True))
    a = _tiered(engine, tmp_path, tp_size=2, debug_tp_digest=True)
    assert _answers(a)[0] == want
    a.shutdown()
    ranks = sorted(d for d in tmp_path.iterdir() if d.is_dir())
    assert len(ranks) == 2, ranks  # one directory a rank: their bytes are different heads
    damaged = sorted(ranks[1].glob("*.kv"))[0]
    data = bytearray(damaged.read_bytes())
    data[-8] ^= 0xFF
    damaged.write_bytes(bytes(data))
    b = _tiered(engine, tmp_path, tp_size=2, debug_tp_digest=True)
    got, cached = _answers(b)
    assert got == want and sum(cached) > 0
    b.shutdown()
    # rank 1 read it, rejected it (deleted), and the page recomputed was written again, whole
    assert not damaged.exists() or damaged.read_bytes() != bytes(data)


def test_the_disk_tier_needs_the_host_tier(engine, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="add enable_hierarchical_cache"):
        engine(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    with pytest.raises(ValueError, match="must be file"):
        engine(enable_hierarchical_cache=True, hicache_storage_backend="s3")


def test_a_worker_killed_while_writing_restarts_clean(model_path, tmp_path: Path) -> None:
    """`tandem serve` with the disk tier, SIGKILLed while requests (and so disk writes) are in
    flight, restarts on the same directory: it starts, answers as a worker without tiers does,
    and its pools are whole; whatever the kill left half-written is never loaded."""
    import concurrent.futures as cf
    import os
    import signal

    import httpx
    from worker_process import Worker, running

    model = model_path("tiny")
    flags = ("--max-total-tokens", "96", "--page-size", "4", "--enable-hierarchical-cache", "--hicache-ratio", "1",
             "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path))
    texts = [f"prompt number {i} " * 12 for i in range(12)]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = Worker.colocated(model, "--max-total-tokens", "96", "--page-size", "4")  # starts meanwhile
    first = Worker.colocated(model, *flags).wait_ready()
    try:
        with cf.ThreadPoolExecutor(4) as ex:
            # 32 new tokens beside a ~60-token prompt: one request fills the 96-token pool, so the others
            # queue behind it and some are in flight when the poll looks (4 tokens each finished before it).
            long = {**sp, "max_new_tokens": 32}
            futures = [ex.submit(httpx.post, first.url + "/generate", json={"text": t, "sampling_params": long},
                                 timeout=60) for t in texts]
            first.wait_running(1)
            os.killpg(first.proc.pid, signal.SIGKILL)  # the worker and its schedulers, mid-traffic
            cf.wait(futures)
    except BaseException:
        plain.stop()
        raise
    finally:
        first.stop()
    again = Worker.colocated(model, *flags)
    with running(plain, again):
        for t in texts * 2:
            body = {"text": t, "sampling_params": sp}
            assert again.post("/generate", body).json()["output_ids"] == plain.post("/generate", body).json()[
                "output_ids"]
        assert again.pool()["whole"], again.output()
        assert again.pool()["ranks"][0]["disk_tier"]["written_pages"] > 0
    assert not list(tmp_path.rglob("*.tmp"))  # the killed writer's temporaries went at the restart
