"""Page identities for automatic prefix caching.

A full page of KV is named by a chained hash: ``hash(previous page's hash, salt, the page's
token ids)``, so equal hashes mean equal tokens at equal positions from the sequence's first
token on, hence equal KV. 128-bit BLAKE2b: a collision (two different prefixes sharing KV) is
as unlikely as one in any content-addressed store; no token compare is kept. The salt names
what else the KV depends on (model, dtype, page size), so identities can be compared across
workers of one model and never across models.

Only full pages are named: a page still being filled can change, and the KV of a sequence's
last token must be computed (its logits sample the next token), so a sequence reuses at most
``(num_tokens - 1) // page_size`` pages.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

PageHash = bytes
_DIGEST_BYTES = 16


def cache_salt(*parts: object) -> bytes:
    """The salt of a pool: what its KV depends on besides the token ids."""
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=_DIGEST_BYTES).digest()


def extend_page_hashes(
    hashes: list[PageHash], token_ids: Sequence[int], page_size: int, num_pages: int, salt: bytes
) -> list[PageHash]:
    """Append to ``hashes`` (the chain of the first ``len(hashes)`` pages of ``token_ids``)
    until it names ``num_pages`` full pages; returns it. Pages past the tokens are not named."""
    num_pages = min(num_pages, len(token_ids) // page_size)
    previous = hashes[-1] if hashes else salt
    for page in range(len(hashes), num_pages):
        tokens = array("q", token_ids[page * page_size : (page + 1) * page_size])
        digest = hashlib.blake2b(previous, digest_size=_DIGEST_BYTES)
        digest.update(tokens.tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes
