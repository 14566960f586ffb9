"""The control channel of a TP rank other than 0: it runs none.

TP rank 0 alone talks to the peer workers (channel.py); its inbox messages reach the other
ranks in the tick (tandem/pd/tick_codec.py). The others run the same role code, so they
get this stand-in, whose sends rank 0's channel makes for them.
"""

from __future__ import annotations

from typing import Any

from tandem.pd.control.frames import Dropped


class FollowerChannel:
    def __init__(self, name: str) -> None:
        self.name = name
        self.dropped = Dropped()

    def bind(self, endpoint: str) -> None:
        pass

    def start(self) -> None:
        pass

    def connect(self, peer: str, endpoint: str) -> None:
        pass

    def send(self, peer: str, msg: Any) -> None:
        pass

    def accept(self, peer: str) -> None:
        pass

    def forget(self, peer: str) -> None:
        pass

    def alive(self) -> bool:
        return True

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass
