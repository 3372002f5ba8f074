"""DeepSeek-V3's multi-token-prediction (MTP) modules, loaded and kept for speculative decoding.

A checkpoint with ``num_nextn_predict_layers = n`` stores ``n`` modules after its last layer
(at layer indices ``num_hidden_layers ..``). Module ``k`` predicts the token ``k + 2`` ahead: it
normalises the previous depth's hidden state (``hnorm``) and the embedding of the next token
(``enorm``), projects their concatenation (``eh_proj``, embedding first), runs one full decoder
layer, and scores the result with its own head (``shared_head``). The forward pass of the main
model does not run them; `workers.engine.mtp_drafter` does, for speculative decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.layers import DecoderLayer
from workers.engine.model_config import ModelConfig
from workers.engine.rms_norm import Reduce, RMSNorm, empty_parameter


class MTPModule(nn.Module):
    NOT_PACKED = ("embed_tokens",)  # an embedding table: rows are looked up, not multiplied

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        index: int,
        reduce: Reduce | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = empty_parameter(config.vocab_size, hidden, dtype=dtype)
        self.enorm = RMSNorm(hidden, eps, dtype)
        self.hnorm = RMSNorm(hidden, eps, dtype)
        self.eh_proj_weight = empty_parameter(hidden, 2 * hidden, dtype=dtype)
        self.layer = DecoderLayer(
            config, dtype, reduce, config.num_layers + index, tp_size, tp_rank
        )
        self.shared_head_norm = RMSNorm(hidden, eps, dtype)
        self.shared_head_weight = empty_parameter(config.vocab_size, hidden, dtype=dtype)
