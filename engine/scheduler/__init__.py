"""The scheduler: requests, queues, batches, the event loops, outputs."""
