"""Prefill/decode disaggregation benchmarks (DistServe, arXiv 2401.09670), on the simulator.

- `slo`: Figure 1's objectives and the attainment arithmetic (TTFT, TPOT, 90%);
- `schedule`: seeded Poisson arrivals on common random numbers;
- `search`: the bisection for the highest rate served;
- `model`: the simulator's engine in virtual time, for fast parameter searches;
- `loadgen`: the streaming load generator (one leg, or prefill then decode legs);
- `calibration`: the `DISTSERVE_OPT13B` preset and the run that checks it against Figure 1;
- `fronts`: what the load is sent through: one instance, vllm-router (PD or round robin);
- `bench`: the first data points (2 prefill + 1 decode behind vllm-router, 3 colocated).

The pure modules (`slo`, `schedule`, `search`, `model`) import none of the others.
"""
