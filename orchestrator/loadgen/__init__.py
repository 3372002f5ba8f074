"""``pdserve bench``: an open-loop load generator over the router's gRPC and HTTP APIs.

One job per module: `requests` (a `orchestrator.sim.workload.Workload` → timed requests with
exact-length token-id prompts, the very list the simulator runs), `records` (what one request
saw, client-side), `clients` (gRPC and HTTP/SSE streaming), `runner` (open-loop arrivals,
safety cap, progress line), `session` (one measured run against a router), `stats`
(percentiles, goodput), `report` (JSON, PNG), `compare` (disaggregated vs colocated clusters
started in-process), `validate` (simulator predictions for the same runs), `commands` (the
argparse side: ``bench run``, ``bench compare``, ``bench validate``).
"""
