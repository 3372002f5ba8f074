"""CUDA `LayerProgress`: the packed progress word is published by stream-ordered device work.

Imported only by `engine_core.create_layer_progress`, for CUDA devices, so CPU hosts never load
it. See `layer_progress` for the protocol.
Untested on CPU-only machines.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.layer_progress import LAYER_BITS, LayerProgress, unpack


class CudaLayerProgress(LayerProgress):
    """Progress word in pinned host memory, written by async device-to-host copies.

    Every update is enqueued on the current stream, so it lands after the layer's kernels and
    can be captured in a CUDA graph: the pass id comes from a device tensor that `begin_pass`
    increments (also stream work), so a replayed graph publishes the current pass, not the one
    seen at capture time.
    """

    def __init__(self, num_layers: int, device: Any) -> None:
        super().__init__(num_layers)
        self._device = torch.device(device)
        # pass_id << 32, kept on the device so captured graphs read it at replay time.
        self._device_base = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._device_word = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._host_word = torch.zeros(1, dtype=torch.int64, pin_memory=True)

    def begin_pass(self) -> int:
        self._pass_id += 1
        self._device_base.add_(1 << LAYER_BITS)
        self._publish(0)
        return self._pass_id

    def mark_layer_done(self, layer: int) -> None:
        self._publish(layer + 1)

    def _publish(self, layers_done: int) -> None:
        torch.add(self._device_base, layers_done, out=self._device_word)
        # One aligned 8-byte store into pinned memory: readers see the old or the new word.
        self._host_word.copy_(self._device_word, non_blocking=True)

    def read(self) -> tuple[int, int]:
        return unpack(int(self._host_word[0]))
