"""`ServingOptions`: the engine and router settings a simulation assumes beyond the batch
limits (`instances.EngineLimits`): speculative decoding, prefix caching and the routing
policy. The defaults are a cluster without drafts, with prefix caching on (a cluster config's
default) and least-outstanding routing (the router's)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from orchestrator.sim.speculative import SpecDecoding

RoutingName = Literal["least_outstanding", "kv_aware"]
ROUTING_POLICIES: tuple[RoutingName, ...] = ("least_outstanding", "kv_aware")


@dataclass(frozen=True)
class ServingOptions:
    """speculative: drafts per step and their acceptance (None: no speculative decoding), on
    decode and mixed instances; a disaggregated cluster drafting with ``mtp`` also runs the
    module over its prompts on the prefill instances (the decoder needs its KV).
    prefix_caching: whether instances find shared prompt prefixes in their caches (`caching`).
    routing: ``least_outstanding``, or ``kv_aware`` (the router's: the decoder holding most of
    the prompt, weighed against load; the prefill instance with the least uncached work).
    kv_cache_weight / kv_load_weight: ``kv_aware``'s score, as the router's
    (`orchestrator.router.policy.KVAwareWeights`; load is outstanding / max_num_seqs).
    seed: of the acceptance draws (`speculative.SpecDecoding.draws`)."""

    speculative: SpecDecoding | None = None
    prefix_caching: bool = True
    routing: RoutingName = "least_outstanding"
    kv_cache_weight: float = 1.0
    kv_load_weight: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        for name in ("kv_cache_weight", "kv_load_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def mtp(self) -> bool:
        """Drafts from the model's MTP module (its passes cost time)."""
        return self.speculative is not None and self.speculative.method == "mtp"

    def label(self) -> str:
        spec = self.speculative.label() if self.speculative else "no speculative decoding"
        caching = "prefix caching " + ("on" if self.prefix_caching else "off")
        return f"{spec}; {caching}; routing {self.routing}"
