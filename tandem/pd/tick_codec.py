"""The PD roles' inbox messages in a tensor-parallel tick (engine/parallel/tick.py).

Only TP rank 0 runs the control channel; what it puts in rank 0's inbox (a peer's frame,
a peer gone) reaches the other ranks in the tick, encoded here. A frame travels as the PD
protocol encodes it and is checked again by pd.decode on every rank: the tick never
carries anything the channel would not have accepted.
"""

from __future__ import annotations

from typing import Any

from tandem.pd import protocol as pd
from tandem.pd.control.channel import PeerDown, PeerMsg


class PDTickCodec:
    def encode(self, msg: Any) -> Any | None:
        if isinstance(msg, PeerMsg):
            return {"peer": msg.peer, "msg": pd.encode(msg.msg).decode()}
        if isinstance(msg, PeerDown):
            return {"peer": msg.peer, "down": msg.reason}
        return None

    def decode(self, obj: Any) -> Any:
        if "down" in obj:
            return PeerDown(str(obj["peer"]), str(obj["down"]))
        return PeerMsg(str(obj["peer"]), pd.decode(obj["msg"].encode()))


TICK_CODEC = PDTickCodec()
