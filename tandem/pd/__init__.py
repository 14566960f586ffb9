"""Prefill/decode disaggregation: what the two roles share (docs/pd.md).

PD is three packages side by side:

- `tandem.pd` (here): the protocol both roles speak (`protocol`, checked field by field
  through `schema`), the control channel that carries it (`control/`: ZMQ, one io thread,
  CURVE with the deployment's `secret`), the KV transfer (`transfer/`: the contract, its
  NIXL implementation, page arithmetic, first-token slots), the handshake identity, and
  `parts`, which sets all of that up for a scheduler;
- `tandem.prefill` (prefill/): the prefill role, the scheduler's part that sends KV;
- `tandem.decode` (decode/): the decode role, the scheduler's part that receives it.

Each role plugs into the engine through one seam, `RolePart`
(engine/scheduler/role_part.py); the engine imports nothing from here. This package
itself imports nothing heavy, so the operator and `tandem up` can use `secret` without
torch, ZMQ or NIXL.
"""
