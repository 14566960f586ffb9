"""KV transfer between workers: the contract (`contract`), the page arithmetic it moves
(`pages`), which KV heads each TP rank writes into which (`head_map`), its NIXL
implementation (`nixl_agent`), and the registered first-token slots that travel with a
request's last chunk (`first_token`)."""
