"""The disk tier below the host tier: KV pages the host tier drops are written to files, one a
page, named by the page's block hash (kv_events.block_hashes: it names the whole prefix the page
ends), so a later match, or a worker restarted on the same model, loads them instead of
prefilling (SGLang's `--hicache-storage-backend file`).

    <dir>/<identity>/<block hash, 16 hex>.kv

    magic "TNDKV\\x01\\n\\x00" | header length (4 bytes) | header (JSON: identity, hash, parent,
    tokens, bytes) | the page's K and V, every layer, as bytes | CRC-32 of header and payload

`identity` names everything the bytes depend on (the model's id, dtype, page size, layers, the KV
heads this TP rank holds, head_dim, the fp8 scales): another model, dtype or layout never reads
them, and a weight reload under new weights starts a new directory.

A file is distrusted until checked: its name, magic, header, identity, hash, parent, tokens,
length and checksum must all agree, or it is deleted and the page recomputed; never loaded.
Writes go through a temporary file renamed into place, so a worker killed mid-write leaves a
temporary that the next start deletes, never a torn page. A writer thread does the file I/O,
off the scheduler's step; the total is kept under a byte budget, least recently used first.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.engine.modelgen.model_id import model_id

log = logging.getLogger(__name__)

MAGIC = b"TNDKV\x01\n\x00"
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 20  # a page's tokens and a few names: far below this


@dataclass
class DiskStats:
    written_pages: int = 0
    loaded_pages: int = 0
    rejected_pages: int = 0  # files that failed a check: deleted, recomputed
    evicted_pages: int = 0  # dropped for the byte budget

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class DiskTier:
    def __init__(self, root: str | Path, identity: str, budget_bytes: int, page_bytes: int) -> None:
        if budget_bytes < page_bytes:
            raise ValueError(f"the disk tier's budget ({budget_bytes} bytes) holds not one page ({page_bytes})")
        self.dir = Path(root) / identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity, self.budget, self.page_bytes = identity, budget_bytes, page_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file size, least recent first
        self._bytes = 0
        self._scan()
        self._queue: queue.Queue[tuple[int, int | None, list[int], bytes] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """A restart's warm start: the pages already here, oldest first; temporaries of a
        writer that died mid-write are deleted."""
        files = []
        for f in self.dir.iterdir():
            if f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)
            elif f.suffix == ".kv" and len(f.stem) == 16:
                try:
                    files.append((f.stat().st_mtime, int(f.stem, 16), f.stat().st_size))
                except (ValueError, OSError):
                    continue
        for _, h, size in sorted(files):
            self._index[h] = size
            self._bytes += size
        self._fit(0)

    # ---- the scheduler's side ----------------------------------------------------------
    def has(self, h: int) -> bool:
        with self._lock:
            return h in self._index

    def put(self, h: int, parent: int | None, tokens: list[int], payload: bytes) -> None:
        """Queue a page for writing (a page already here is not written again)."""
        if not self.has(h):
            self._queue.put((h, parent, tokens, payload))

    def get(self, h: int, parent: int | None, tokens: list[int]) -> bytes | None:
        """The page's bytes, or None when it is absent or fails any check (then deleted)."""
        path = self._path(h)
        with self._lock:
            if h not in self._index:
                return None
            self._index.move_to_end(h)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(h, rejected=True)
            return None
        payload = self._check(data, h, parent, tokens)
        if payload is None:
            log.warning("disk KV tier: %s failed its check; deleted, the page will be recomputed", path.name)
            self._forget(h, rejected=True)
            return None
        self.stats.loaded_pages += 1
        try:
            os.utime(path)  # a restart orders pages by their last use
        except OSError:
            pass
        return payload

    def flush(self) -> None:
        """Wait until every queued page is written (or failed)."""
        self._queue.join()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout)

    def used_bytes(self) -> int:
        with self._lock:
            return self._bytes

    # ---- files ---------------------------------------------------------------------------
    def _path(self, h: int) -> Path:
        return self.dir / f"{h:016x}.kv"

    def _check(self, data: bytes, h: int, parent: int | None, tokens: list[int]) -> bytes | None:
        head = len(MAGIC) + _LEN.size
        if len(data) < head + 4 or data[: len(MAGIC)] != MAGIC:
            return None
        (n,) = _LEN.unpack_from(data, len(MAGIC))
        if n > MAX_HEADER or len(data) != head + n + self.page_bytes + 4:
            return None
        body = data[head:-4]
        if zlib.crc32(body) != int.from_bytes(data[-4:], "little"):
            return None
        try:
            header = json.loads(body[:n])
        except ValueError:
            return None
        want = {"identity": self.identity, "hash": h, "parent": parent, "tokens": tokens, "bytes": self.page_bytes}
        if header != want:
            return None
        return body[n:]

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, h: int, parent: int | None, tokens: list[int], payload: bytes) -> None:
        if self.has(h) or len(payload) != self.page_bytes:
            return
        header = json.dumps({"identity": self.identity, "hash": h, "parent": parent, "tokens": tokens,
                             "bytes": self.page_bytes}).encode()
        body = header + payload
        data = MAGIC + _LEN.pack(len(header)) + body + zlib.crc32(body).to_bytes(4, "little")
        path = self._path(h)
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")  # DP ranks share a dir
        try:
            self._fit(len(data))
            tmp.write_bytes(data)
            os.replace(tmp, path)  # whole or absent: a kill mid-write leaves only the temporary
        except OSError:
            log.exception("disk KV tier: writing %s failed", path.name)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._index[h] = len(data)
            self._bytes += len(data)
        self.stats.written_pages += 1

    def _fit(self, incoming: int) -> None:
        """Delete the least recently used pages until `incoming` more bytes fit the budget."""
        while True:
            with self._lock:
                if self._bytes + incoming <= self.budget or not self._index:
                    return
                h, size = self._index.popitem(last=False)
                self._bytes -= size
            self._path(h).unlink(missing_ok=True)
            self.stats.evicted_pages += 1

    def _forget(self, h: int, rejected: bool) -> None:
        with self._lock:
            size = self._index.pop(h, None)
            if size is not None:
                self._bytes -= size
        self._path(h).unlink(missing_ok=True)
        if rejected:
            self.stats.rejected_pages += 1


def disk_tier(config: Any, runner: Any, kv_pool: Any, host: Any) -> DiskTier:
    """The disk tier of this TP rank: its identity names everything its pages' bytes depend on."""
    from tandem.engine.modelgen.model_builder import tandem_home

    layout = kv_pool.layout()
    identity = "-".join((
        model_id(runner.model_config.path), layout.dtype, f"p{layout.page_size}", f"l{layout.num_layers}",
        f"h{layout.head_start}+{layout.num_kv_heads}of{layout.total_heads}", f"d{layout.head_dim}",
        kv_pool.scales.digest()))
    root = config.hicache_storage_dir or tandem_home() / "kv-disk"
    return DiskTier(root, identity, int(config.hicache_storage_size * 2**30), host.page_bytes)
