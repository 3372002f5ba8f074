"""Per-layer progress of the running forward pass, readable from another thread without locks.

The prefill engine's forward pass calls `LayerProgress.begin_pass` before layer 0 and
`LayerProgress.mark_layer_done(layer)` right after each layer's attention output projection
(docs/design.md §3.4). The KV messenger's push thread calls `LayerProgress.read` and starts the RDMA
writes of every layer that has finished since it last looked.

Wake-ups. Readers need not poll: `add_listener(callback)` makes the writer call ``callback()``
(on the forward thread, right after each store) at every `begin_pass` and `mark_layer_done`.
A listener must only signal (e.g. ``threading.Event.set``): it runs between two layers. Read
after clearing your signal, wait on it, read again: a store after the read always signals.
`notifies` is False for a subclass that publishes the word elsewhere (the CUDA variant's word
is written by the device, so nothing on the host can call a listener): readers then poll.

Ordering / consistency. The state is one 64-bit word ``(pass_id << 32) | layers_done`` that the
forward thread replaces with a single store. A reader therefore always sees a pair that existed:
it can never combine a new pass's ``layers_done`` with the previous ``pass_id`` (which would make
it re-send layers of a finished pass) nor the previous pass's ``layers_done`` with a new
``pass_id`` (which would make it send pages the new pass has not written yet). Within a pass
``layers_done`` only grows. On CPU the word is a Python int attribute: rebinding an attribute is
a single atomic store under the GIL (and under free-threaded CPython's per-object locking), and
the KV writes of layer ``l`` happen-before the store that publishes ``l + 1`` because they are
ordinary writes by the same thread that precede it.

GPU variant (`layer_progress_cuda.CudaLayerProgress`, imported by the engine only when it runs
on CUDA: `engine_core.create_layer_progress`). The word lives in host-mapped pinned memory.
``begin_pass`` increments a device-side pass counter; ``mark_layer_done`` launches, on the
compute stream, a tiny device op that computes the packed word from that counter and copies it
(8 bytes, one aligned store, so atomic) to the pinned word.
Being ordinary stream work, it runs after the layer's kernels and is captured by CUDA graphs
(the pass id is read from device memory at replay time, not baked into the graph). The poller
thread reads the pinned word with a plain load; it never synchronises the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

LAYER_BITS = 32  # low bits of the word: layers_done; the high bits: pass_id
_LAYER_MASK = (1 << LAYER_BITS) - 1


def pack(pass_id: int, layers_done: int) -> int:
    return (pass_id << LAYER_BITS) | layers_done


def unpack(word: int) -> tuple[int, int]:
    return word >> LAYER_BITS, word & _LAYER_MASK


class LayerProgress:
    """Lock-free (pass_id, layers_done) counter for a single writer and any number of readers.

    ``pass_id`` starts at 0 (no pass yet); the first `begin_pass` makes it 1.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._word = pack(0, 0)
        self._pass_id = 0  # writer-private copy, so begin_pass never reads the shared word
        # Rebound, never mutated: the writer iterates a snapshot without a lock.
        self._listeners: tuple[Callable[[], None], ...] = ()

    @property
    def notifies(self) -> bool:
        """True when every update calls the listeners (this class's own writer methods)."""
        cls = type(self)
        return (
            cls.begin_pass is LayerProgress.begin_pass
            and cls.mark_layer_done is LayerProgress.mark_layer_done
        )

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every update (forward thread; it must only signal)."""
        self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners = tuple(known for known in self._listeners if known != listener)

    def begin_pass(self) -> int:
        """Start a new pass with no layer done; returns its pass id."""
        self._pass_id += 1
        self._word = pack(self._pass_id, 0)
        for listener in self._listeners:
            listener()
        return self._pass_id

    def mark_layer_done(self, layer: int) -> None:
        """Layer ``layer`` (0-based) of the current pass has written its KV and projected."""
        self._word = pack(self._pass_id, layer + 1)
        for listener in self._listeners:
            listener()

    def read(self) -> tuple[int, int]:
        """(pass_id, layers_done) of the latest pass, as one consistent snapshot."""
        return unpack(self._word)

    def wait_for(self, pass_id: int, layers: int, timeout: float) -> bool:
        """Poll until pass ``pass_id`` has ``layers`` layers done (or a later pass started).

        Returns False on timeout. A convenience for tests; the messenger reads `read` itself.
        """
        deadline = time.monotonic() + timeout
        while True:
            current, done = self.read()
            if current > pass_id or (current == pass_id and done >= layers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
