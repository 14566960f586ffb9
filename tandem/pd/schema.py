"""Strict shapes for what crosses the PD control channel, torch-free.

Everything a peer sends is checked here before any field is used: exact keys, exact
types (a bool is not an int), bounded ints, strings and lists. A check returns the value
or raises BadMessage naming the path of the first bad field, never its value (a hostile
or corrupt frame must not be echoed into logs at length).

    spec = record({"room": uint(2**63), "pages": int_list(1 << 18, 2**31)})
    spec(obj, "KVDest")   # -> obj, or BadMessage("KVDest.pages[3]: ...")

A relation between fields (a range inside a total) is `where(spec, rule, what)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Spec = Callable[[Any, str], Any]


class BadMessage(ValueError):
    """A control message (or NIXL notification) that is not one this protocol sends."""


def uint(hi: int, lo: int = 0) -> Spec:
    """An int in [lo, hi)."""

    def check(v: Any, path: str) -> int:
        if type(v) is not int or not lo <= v < hi:
            raise BadMessage(f"{path}: an integer in [{lo}, {hi}) expected, got {type(v).__name__}")
        return v

    return check


def text(max_len: int) -> Spec:
    def check(v: Any, path: str) -> str:
        if type(v) is not str or len(v) > max_len:
            raise BadMessage(f"{path}: a string of at most {max_len} characters expected, got {type(v).__name__}")
        return v

    return check


def one_of(*values: str) -> Spec:
    """One of a few known strings."""

    def check(v: Any, path: str) -> str:
        if type(v) is not str or v not in values:
            raise BadMessage(f"{path}: one of {', '.join(values)} expected")
        return v

    return check


def boolean(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise BadMessage(f"{path}: a boolean expected, got {type(v).__name__}")
    return v


def int_list(max_len: int, hi: int) -> Spec:
    """A list of at most max_len ints in [0, hi)."""
    return list_of(uint(hi), max_len, "integers")


def list_of(item: Spec, max_len: int, what: str = "items") -> Spec:
    """A list of at most max_len values, each passing `item`."""

    def check(v: Any, path: str) -> list[Any]:
        if type(v) is not list or len(v) > max_len:
            raise BadMessage(f"{path}: a list of at most {max_len} {what} expected, got {type(v).__name__}")
        for i, x in enumerate(v):
            item(x, f"{path}[{i}]")
        return v

    return check


def record(fields: Mapping[str, Spec], may_be_empty: bool = False) -> Spec:
    """A JSON object with exactly these keys (or, with may_be_empty, exactly none)."""

    def check(v: Any, path: str) -> dict[str, Any]:
        if type(v) is not dict:
            raise BadMessage(f"{path}: an object expected, got {type(v).__name__}")
        if may_be_empty and not v:
            return v
        if v.keys() != fields.keys():
            missing, extra = sorted(fields.keys() - v.keys()), len(v.keys() - fields.keys())
            raise BadMessage(f"{path}: keys {sorted(fields)} expected (missing {missing}, {extra} unknown)")
        for k, spec in fields.items():
            spec(v[k], f"{path}.{k}")
        return v

    return check


def where(spec: Spec, rule: Callable[[Any], bool], what: str) -> Spec:
    """`spec`, then `rule` over the value it passed (fields checked, so the rule may use them)."""

    def check(v: Any, path: str) -> Any:
        v = spec(v, path)
        if not rule(v):
            raise BadMessage(f"{path}: {what}")
        return v

    return check
