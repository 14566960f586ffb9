"""Field checks the spec parsers share: each appends a message to `errors` and returns a safe
stand-in, so one pass reports every problem of a spec at once."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Upper bounds the operator enforces itself, not only through the CRD schema (a CR can reach
# it unvalidated: an old CRD, a dry run, `tandem operator render`).
MAX_REPLICAS = 10_000
MAX_TENSOR_PARALLEL = 64
MAX_SECONDS = 86_400
MAX_HOST_CACHE_GIB = 4096


def _int(value: Any, where: str, errors: list[str], lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        errors.append(f"{where} must be an integer {bound}, got {value!r}")
        return lo
    return value


def _num(value: Any, where: str, errors: list[str]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        errors.append(f"{where} must be a positive number, got {value!r}")
        return 1.0
    return float(value)


def _choice(value: Any, choices: tuple[str, ...], where: str, errors: list[str]) -> str | None:
    if value is None or value in choices:
        return value
    errors.append(f"{where} must be one of {list(choices)}, got {str(value)[:64]!r}")
    return None


@dataclass(frozen=True)
class NameRule:
    """A Kubernetes name format: the schema's `pattern` and `maxLength`, and the words an error uses."""

    pattern: str
    max_length: int
    what: str


DNS_LABEL = NameRule(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", 63, "a DNS label (lowercase letters, digits and '-')")
DNS_SUBDOMAIN = NameRule(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", 253,
                         "a DNS subdomain (DNS labels joined by '.')")
# Gateway API's Hostname: a DNS subdomain, or one under a leading wildcard label ("*.example.com").
HOSTNAME = NameRule(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", 253,
                    "a hostname such as llm.example.com or *.example.com")
# Gateway API's Duration (GEP-2257), the pattern of HTTPRoute's rules[].timeouts.request verbatim: one to four
# <1-5 digits><unit> groups, so at most 4 * 7 = 28 characters. A zero duration ("0s") means no timeout.
GATEWAY_DURATION = NameRule(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$", 28,
                            "a Gateway API duration such as 600s, 10m or 1h30m (units h, m, s, ms)")


def _name(value: Any, rule: NameRule, where: str, errors: list[str]) -> str | None:
    """`value` when it is a string of the rule's format, None for an absent one; else an error."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > rule.max_length or not re.fullmatch(rule.pattern, value):
        errors.append(f"{where} must be {rule.what}, at most {rule.max_length} characters, got {str(value)[:64]!r}")
        return None
    return value
