"""Stand-ins for the bridge's outside world in the unit tests, type-checked against the
protocols the bridge asks of the real ones (mypy's files in pyproject.toml)."""
