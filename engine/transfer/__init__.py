"""KV transfer between workers: the contract (base.py), the page arithmetic it moves
(pages.py), and its NIXL implementation (nixl_agent.py)."""
