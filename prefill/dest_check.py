"""Whether a decode's KVDest fits the request it names, checked when it arrives.

Everything in a KVDest is the peer's word: the pages, the first-token slot and the staging
pages are indices into decode's buffers, which prefill turns into NIXL addresses chunk
after chunk. Checked here once, before the request is computed, against the prompt and the
bounds decode's own handshake declared (parts.Link: the least over its ranks, so every
prefill rank judges alike): a bad one fails its request alone, with the reason, and nothing
later in the send path meets an index it has not seen checked.
"""

from __future__ import annotations

from tandem.pd import protocol as pd
from tandem.pd.parts import Link


def dest_problem(dest: pd.KVDest, prompt_len: int, page_size: int, link: Link) -> str | None:
    """Why `dest` cannot take a prompt of `prompt_len` tokens from decode `link`; None if it can."""
    P = page_size
    want = -(-prompt_len // P) - dest.skip // P
    if dest.prompt_len != prompt_len or dest.skip % P or dest.skip > prompt_len or len(dest.pages) != want:
        return (f"{len(dest.pages)} pages for {prompt_len} tokens from {dest.skip}; "
                f"{dest.prompt_len} tokens on decode")
    bad = next((p for p in dest.pages if not 0 < p < link.pages), None)  # page 0 is decode's pad page
    if bad is not None:
        return f"page {bad} outside decode's 1..{link.pages - 1}"
    if dest.slot >= link.slots:
        return f"first-token slot {dest.slot} outside decode's 0..{link.slots - 1}"
    return link.staging.problem(dest.staging, want)  # head-slice staging pages (head_map.Staging)
