"""Engine configuration: one frozen dataclass, validated once at construction.

Values measured or derived at run time (the page count computed from a memory budget, the
model's own ``max_model_len`` when none is given) live in ``EngineCore`` / ``KVCachePool``, never
written back here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from workers.engine.device import check_device_name
from workers.engine.speculative import SpeculativeConfig

Role = Literal["mixed", "prefill", "decode"]

ROLES: tuple[str, ...] = ("mixed", "prefill", "decode")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "flashinfer")

# Used when neither ``num_pages`` nor ``kv_memory_bytes`` is given.
DEFAULT_KV_MEMORY_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs.

    role: ``mixed`` runs prefill chunks and decodes in one batch; ``prefill`` computes KV for all
        prompt tokens but the last and never samples; ``decode`` admits requests whose prompt KV
        was written into its pages by someone else and runs the last prompt token as the first
        decode step.
    num_pages / kv_memory_bytes: size of the KV pool, allocated up front. Give at most one; with
        neither, ``DEFAULT_KV_MEMORY_BYTES`` is used.
    max_num_batched_tokens: token budget of one step (prefill chunk tokens + one per decode).
    max_model_len: prompt + output limit per request; ``None`` means the model's own limit.
    device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (`workers.engine.device`); whether the
        device exists is checked when the engine starts, before anything is loaded.
    cuda_graph_max_batch: on CUDA, decode steps of up to this many sequences replay CUDA
        graphs (`workers.engine.decode_graphs`); 0 runs every step eagerly. Ignored on CPU.
    enable_prefix_caching: reuse the KV of full pages whose tokens (from the sequence's start)
        match an earlier sequence's (`workers.engine.prefix_cache`). Prefill role: a cached
        prefix is not computed again (its pages are still sent); decode role: finished
        requests' pages stay cached and a prompt's cached prefix is not transferred again.
        Not with MTP speculative decoding or ``mtp_kv`` yet (the cache keeps no MTP-layer KV).
    speculative: speculative decoding (`workers.engine.speculative`): drafts verified by the
        model, lossless; mixed and decode roles (with prefix caching for ngram and draft-model
        drafts, not MTP). None: off.
    mtp_kv: prefill role: also run the checkpoint's MTP module over the prompt and send its KV
        as the pool's last layer, which decoders that draft with ``mtp`` need (the cluster
        sets it on the prefill group when its decode group does).
    min_step_interval_s: a step that only decodes starts at least this long after the previous
        step started (`workers.engine.step_loop`); 0: at once. For workers sharing cores.
    tensor_parallel_size: ranks (processes) the model is split over; rank 0 runs the engine.
        Whether the model's heads divide is checked when it is loaded. With TP, ``num_pages``
        / ``kv_memory_bytes`` size each rank's pool (its share of the KV heads).
    """

    role: Role = "mixed"
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    cuda_graph_max_batch: int = 64
    attention_backend: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = False
    speculative: SpeculativeConfig | None = None
    mtp_kv: bool = False
    min_step_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.num_pages is not None and self.kv_memory_bytes is not None:
            raise ValueError("give num_pages or kv_memory_bytes, not both")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.enable_chunked_prefill and self.max_num_batched_tokens < self.page_size:
            # Chunks other than a prompt's last end on a page boundary, so a step must be able to
            # hold at least one whole page of a long prompt.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"page_size ({self.page_size}) with chunked prefill"
            )
        if self.max_model_len is not None:
            if self.max_model_len < 2:
                raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
            self.check_max_model_len(self.max_model_len)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check_device_name(self.device)
        if self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.enable_prefix_caching and self.mtp_kv:
            # A page's MTP-layer KV depends on the token after the page, which its name omits.
            raise ValueError("mtp_kv with enable_prefix_caching is not supported yet")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            # As it arrives from a serialised config (a worker's spec): a plain mapping.
            raw = cast(Mapping[str, Any], self.speculative)
            object.__setattr__(self, "speculative", SpeculativeConfig.from_dict(dict(raw)))
        if self.speculative is not None:
            if self.role == "prefill":
                raise ValueError("speculative decoding runs on mixed and decode workers")
            if self.enable_prefix_caching and self.speculative.method == "mtp":
                # A cached prefix has no MTP-layer KV (the cache keeps the model's layers only),
                # so a request that hit the cache would never get an MTP draft.
                raise ValueError(
                    "MTP speculative decoding with enable_prefix_caching is not supported yet"
                )
        if not 0.0 <= self.min_step_interval_s <= 1.0:  # also refuses NaN
            raise ValueError(
                f"min_step_interval_s must be within 0-1 s, got {self.min_step_interval_s}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

    @property
    def mtp_layers(self) -> int:
        """Layers the KV pool holds past the model's: the MTP module's, when drafting with it
        or computing it for decoders that do (`workers.engine.mtp_drafter`)."""
        spec = self.speculative
        return int(self.mtp_kv or (spec is not None and spec.method == "mtp"))

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise ValueError when a sequence of ``max_model_len`` tokens could never be scheduled.

        Called here for an explicit ``max_model_len`` and by the engine once it knows the
        model's own limit. Without chunked prefill a prompt (or a preempted sequence being
        recomputed) runs in one step; one longer than the step budget would wait forever and
        block every request queued behind it.
        """
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            source = "" if self.max_model_len is not None else ", the model's limit"
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}{source}), or long prompts could never run; "
                "raise max_num_batched_tokens, lower max_model_len or enable chunked prefill"
            )
