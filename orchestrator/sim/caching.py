"""Prefix caching in the simulator: what one instance's cache holds of a request's prompt.

The engine names full pages by a chained hash of their tokens from the sequence's start
(`workers.engine.prefix_cache`), keeps a named page cached once its last owner lets it go,
until its room is needed (least recently freed first), and computes only what its cache
lacks (at least one token: the last prefilled one). So a hit is a prefix of whole pages.

The simulator tracks contents, not tokens: per conversation, the length of the prefix an
instance holds (what the turn it served left there: a prefill instance the prompt it pushed,
a decoder or mixed instance the prompt and the answer its steps computed), and a request's
``num_common_tokens`` (a system prompt, or a workload's hit rate) as held everywhere. A held
conversation counts against the instance's free KV: it is evicted, least recently kept first,
when admitted requests' reservations leave it no room; a request that reuses it takes it out
of the cache (its pages are the request's own until it ends, `take`).
"""

from __future__ import annotations

from collections import OrderedDict

from orchestrator.sim.workload import RequestSpec


class PrefixCache:
    def __init__(self, page_size: int, enabled: bool) -> None:
        self.page_size, self.enabled = page_size, enabled
        self._held: OrderedDict[int, int] = OrderedDict()  # conversation -> tokens, LRU first
        self.num_held_tokens = 0

    def hit(self, spec: RequestSpec, usable: int) -> int:
        """Tokens of the first ``usable`` of the prompt found cached here: whole pages."""
        if not self.enabled:
            return 0
        held = spec.num_common_tokens
        if spec.conversation >= 0:
            history = min(self._held.get(spec.conversation, 0), spec.num_history_tokens)
            held = max(held, history)
        return max(0, min(held, usable)) // self.page_size * self.page_size

    def take(self, spec: RequestSpec) -> None:
        """The request now owns its conversation's cached pages (none are evictable)."""
        if spec.conversation >= 0 and spec.conversation in self._held:
            self.num_held_tokens -= self._held.pop(spec.conversation)

    def keep(self, spec: RequestSpec, num_tokens: int, room: int) -> None:
        """The request let go of its pages: ``num_tokens`` of them stay cached as its
        conversation's (whole pages), within ``room`` free KV tokens."""
        if not self.enabled or spec.conversation < 0:
            return
        self.take(spec)
        tokens = num_tokens // self.page_size * self.page_size
        if tokens:
            self._held[spec.conversation] = tokens
            self.num_held_tokens += tokens
        self.fit(room)

    def fit(self, room: int) -> None:
        """Evict least recently kept conversations until the cache fits in ``room`` tokens."""
        while self._held and self.num_held_tokens > max(0, room):
            _, tokens = self._held.popitem(last=False)
            self.num_held_tokens -= tokens
