"""Cluster simulator and planner: a discrete-event model of the router, prefill, decode and
mixed instances (`simulator`), pluggable step-time cost models (`cost`, `roofline`,
`calibrated`), workloads (`workload`, `conversations`), serving options (`options`:
speculative decoding, prefix caching, routing) and a DistServe-style P:D / TP search
(`planner`).

Nothing here imports torch or Ray: the simulator runs anywhere, the calibration command
(`calibrated.run_calibration`) imports the engine lazily."""
