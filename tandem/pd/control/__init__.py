"""The PD control channel: one ZMQ socket per peer, owned by one io thread per scheduler
process (`channel`), bounded and counted frames (`frames`), CURVE authentication (`auth`)."""
