"""Model execution engine: model building, runners, attention backends."""
