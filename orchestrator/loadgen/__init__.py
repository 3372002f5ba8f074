"""``pdserve bench``: an open-loop load generator over the router's gRPC and HTTP APIs.

One job per module: `requests` (a `orchestrator.sim.workload.Workload` → timed requests with
exact-length token-id prompts, the very list the simulator runs), `records` (what one request
saw, client-side), `clients` (gRPC and HTTP/SSE streaming), `runner` (open-loop arrivals,
safety cap, progress line), `session` (one measured run against a router), `stats`
(percentiles, goodput), `report` (JSON, PNG), `compare` (disaggregated vs colocated clusters
started in-process), `goodput` (SLO attainment over seeds, the goodput rate of a rate sweep and
its bisection), `sweep` (both clusters over rates and seeds, each started once),
`sweep_report` (its JSON, table, PNG), `sweep_command` (``bench sweep``'s checks and flow),
`validate` (simulator predictions for the same runs), `commands` (the argparse side:
``bench run``, ``bench compare``, ``bench sweep``, ``bench validate``).
"""
