"""Tool calls in a chat answer: the formats models write them in (hermes, llama3_json, mistral),
the scanner that finds them in text as it streams, and the call sources for each tool_choice."""
