"""A simulated vLLM (batching, prefix cache, vLLM's routes) for `gateway --simulate` and tests.

It lives in the gateway package so the wheel needs no top-level package of its own; the
load tools in `loadtest/` (run from a checkout) import it from here.
"""
