"""PD with the host tier on decode: decode's prefix reuse counts what its host tier holds. A
second turn whose first turn the small decode pool evicted is loaded back from decode's host
tier before the room's transfer, so prefill sends only the new pages; the answers equal a
colocated worker's. Second turns arriving together, each loading its prefix while the others
hold room, are admitted as room allows (a loaded prefix, once locked, is no longer evictable
room: `tandem up` crashed a decode on exactly that). Pools (device and host) whole after."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from pd_client import pd_generate, pd_stats
from worker_process import Worker, running

pytest.importorskip("tandem.pd.transfer.nixl_agent").nixl_api()

SP = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
FLAGS = ("--page-size", "16", "--chunked-prefill-size", "64")


def test_decode_reuses_what_its_host_tier_holds(model_path) -> None:
    model = model_path("tiny")
    pre = Worker.prefill(model, *FLAGS, "--max-total-tokens", "4096")
    dec = Worker.decode(model, *FLAGS, "--max-total-tokens", "384", "--enable-hierarchical-cache",
                        "--hicache-ratio", "8", "--pd-local-prefill-threshold", "0", peers=[pre])
    col = Worker.colocated(model, *FLAGS, "--max-total-tokens", "4096")
    chats = [f"conversation {c} about topic {c}: " + " ".join(f"fact{c}_{i}" for i in range(40)) for c in range(6)]
    with running(pre, dec, col):
        firsts = [pd_generate(pre, dec, {"text": c, "sampling_params": SP}) for c in chats]
        before = pd_stats(pre)[0]["kv_bytes_sent"], pd_stats(dec)[0]["reused_tokens"]
        seconds = []
        for c in chats:  # each second turn: its first turn was evicted from decode's 384-token pool
            seconds.append(pd_generate(pre, dec, {"text": c + " and a follow-up question", "sampling_params": SP}))
        sent = pd_stats(pre)[0]["kv_bytes_sent"] - before[0]
        reused = pd_stats(dec)[0]["reused_tokens"] - before[1]
        want = [col.post("/generate", {"text": t, "sampling_params": SP}).json()["output_ids"]
                for c in chats for t in (c, c + " and a follow-up question")]
        assert [x["output_ids"] for pair in zip(firsts, seconds) for x in pair] == want
        n_first = sum(f["meta_info"]["prompt_tokens"] for f in firsts)
        assert reused >= n_first - 6 * 16, (reused, n_first)  # each first turn, but its last partial page
        assert sent < before[0] / 2  # only the new tokens' pages moved
        host = dec.pool()["ranks"][0]["host_tier"]
        assert host["loaded_tokens"] > 0 and host["written_tokens"] > 0, host
        thirds = [c + " and a follow-up question, then a third one" for c in chats]
        with cf.ThreadPoolExecutor(6) as ex:  # all at once: prealloc under pressure, prefixes loading
            got = list(ex.map(lambda t: pd_generate(pre, dec, {"text": t, "sampling_params": SP})["output_ids"],
                              thirds))
        assert got == [col.post("/generate", {"text": t, "sampling_params": SP}).json()["output_ids"] for t in thirds]
        for w in (pre, dec, col):
            assert w.pool()["whole"], w.output()
