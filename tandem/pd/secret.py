"""The PD secret: one key shared by every prefill and decode worker of a deployment.

It authenticates the PD control channel (ZMQ CURVE, tandem/pd/control/auth.py):
every worker uses it as its CURVE secret key and derives the one public key a peer must
present. It is 32 random bytes in Z85 (40 characters of ZMQ's base-85 alphabet), which
is how libzmq takes a CURVE key. torch-free and zmq-free: the operator creates one per
InferenceService (a Kubernetes Secret, key PD_SECRET_KEY, passed as the env
worker_contract.ENV_PD_SECRET) and `tandem up` one per run, both with new_pd_secret().
"""

from __future__ import annotations

import secrets

Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
SECRET_CHARS = 40  # 32 bytes: 5 characters per 4 bytes


def new_pd_secret() -> str:
    raw = secrets.token_bytes(32)
    out = []
    for i in range(0, len(raw), 4):
        n = int.from_bytes(raw[i : i + 4], "big")
        group = []
        for _ in range(5):
            n, digit = divmod(n, 85)
            group.append(Z85[digit])
        out += reversed(group)
    return "".join(out)


def check_pd_secret(secret: str) -> str:
    """`secret` if it is a Z85 CURVE key; a ValueError that never shows the value otherwise."""
    ok = len(secret) == SECRET_CHARS and all(c in Z85 for c in secret)
    for i in range(0, SECRET_CHARS, 5) if ok else ():
        value = 0
        for c in secret[i : i + 5]:
            value = value * 85 + Z85.index(c)
        ok = ok and value < 2**32  # five base-85 digits can exceed the four bytes they stand for
    if not ok:
        raise ValueError(f"the PD secret must be {SECRET_CHARS} characters of Z85 (new_pd_secret() makes one); "
                         f"the one given ({len(secret)} characters) is not")
    return secret
