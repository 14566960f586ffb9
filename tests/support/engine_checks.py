"""The check every engine test ends with: the scheduler still runs and its pools are whole."""

from __future__ import annotations

from tandem import Engine


def assert_whole(eng: Engine) -> None:
    """No scheduler error, and a flush (which needs the engine idle) finds every KV page free
    and the integrity check passed: free + cached + in-use pages add up, no lock leaked."""
    assert eng.error is None, f"the scheduler stopped: {eng.error!r}"
    for reply in eng.flush_cache():
        assert reply.ok, reply.info
        assert reply.info["free_tokens"] == reply.info["capacity_tokens"], reply.info
