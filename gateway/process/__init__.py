"""The process: serve until a signal, reload on SIGHUP, run N workers on one port.

`serve` (bind, serve, drain), `reload` (a new config applied in place, or refused),
`watch` (a reload when the files change), `workers` (the supervisor and its worker
processes).
May import: every package below it, and `gateway.sim` for `--simulate`.
"""
