"""Configuration: the two files validated once into frozen values, and what start-up checks.

`schema` (the pydantic models of config.toml and settings.json), `load` (reading, `${VAR}`
expansion, the `Config` every other package reads), `urls` (an instance URL compared and
written one way), `preflight` (what would only fail once serving: bind, headers, duplicates).
May import: the shared vocabulary (`gateway.errors`, `gateway.routes`) and `gateway.dispatch`.
"""
