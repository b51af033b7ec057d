"""Load-test tooling: simulated vLLM instances and fleets of them."""
