"""The settings of the static decoder beyond its model and slots (:class:`DecoderConfig`):
its int4 weights and what it compiles and captures. No torch here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from convo.errors import ConfigError
from convo.models.defaults import MIXED_CHUNK_TOKENS, PREFILL_GRAPH_TOKENS
from convo.models.quant import INT4_KERNELS, LARGEST_INT4_GROUP_SIZE


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """How a :class:`~convo.fast.decoder.StaticDecoder` holds its weights and runs its steps.

    Args:
        group_size: with ``weights="int4"``, the preferred int4 group (input features per
            scale/zero pair). Default the largest the kernels take,
            :data:`~convo.models.quant.LARGEST_INT4_GROUP_SIZE` (128); smaller where a
            shape needs it (:func:`~convo.models.quant.int4_group_size`). The engine passes
            its own (:data:`~convo.models.quant.INT4_GROUP_SIZE`, 32, by default).
        int4_kernel: the int4 layouts kept, which decide the kernels
            (:mod:`convo.fast.int4`): ``"triton"`` (the plain layout alone: convo's W4A16
            Triton kernel up to :data:`~convo.fast.int4.W4_KERNEL_MAX_ROWS` rows,
            dequantized once for cuBLAS above), ``"tinygemm"`` (PyTorch's tile-packed
            layout alone, at every row count: slow prefill), or ``"auto"`` (default): both
            on CUDA with Triton (tinygemm for steps of up to
            :data:`~convo.fast.int4.TINYGEMM_MAX_ROWS` rows), else tinygemm's.
        free_dense: after quantizing to int4, drop the model's dense linear weights (the
            model can then only run through the decoder). Default False.
        dense_copy_bytes: with int4 weights, keep dense copies (the compute dtype) of the
            layers' int4 weights, up to this many bytes, layer by layer from the first
            (:meth:`~convo.fast.int4.Int4Linear.keep_dense`): steps of more than
            :data:`~convo.fast.int4.DENSE_COPY_MIN_ROWS` rows (mixed steps, prefill chunks)
            multiply them instead of dequantizing the weight each time, decode steps still
            read the int4 weight. Memory for prefill speed, where a card has room beyond
            its KV slots (Llama-2-7B: 12.1 GiB for every layer). Default 0: none.
        compile: fuse each layer's pointwise work with ``torch.compile``. Default ``None``:
            on CUDA with plain or int4 weights.
        cuda_graphs: capture the decode step per batch bucket, and prefill per chunk-size
            bucket. Default ``None``: on CUDA.
        static_prefill: run prefill through the static-shape forward that the graphs
            capture (chunks padded to a bucket, attention over the whole slot under a
            mask). Default ``None``: with ``cuda_graphs``; tests set it on CPU to check
            that forward.
        prefill_chunk_tokens: prefill runs in chunks of this many tokens, and the largest
            captured prefill is this long. Default
            :data:`~convo.models.defaults.PREFILL_GRAPH_TOKENS` (512).
        mixed_chunk_tokens: with ``cuda_graphs``, the mixed step (decode rows and the
            prefill chunks of up to :data:`~convo.models.defaults.MIXED_PACK_CHUNKS` turns,
            packed, in one forward) is captured for every decode bucket and every prefill
            bucket up to this many tokens. Default
            :data:`~convo.models.defaults.MIXED_CHUNK_TOKENS` (512: twice the scheduler's
            chunk while replies stream, which grows to it under a pile of prompts); 0: no
            mixed graphs (a decode replay, then a prefill replay).
        buckets: batch sizes (rows) to build the step for. Default ``None``: powers of two
            up to the next one >= the slots. Fewer buckets, fewer captures; steps of more
            rows than the largest bucket are refused.

    Raises:
        ConfigError: a size out of range or an unknown int4 kernel.
    """

    group_size: int = LARGEST_INT4_GROUP_SIZE
    int4_kernel: str = "auto"
    free_dense: bool = False
    dense_copy_bytes: int = 0
    compile: bool | None = None
    cuda_graphs: bool | None = None
    static_prefill: bool | None = None
    prefill_chunk_tokens: int = PREFILL_GRAPH_TOKENS
    mixed_chunk_tokens: int = MIXED_CHUNK_TOKENS
    buckets: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk_tokens < 1:
            raise ConfigError("prefill_chunk_tokens must be >= 1")
        if self.mixed_chunk_tokens < 0:
            raise ConfigError("mixed_chunk_tokens must be >= 0")
        if self.dense_copy_bytes < 0:
            raise ConfigError("dense_copy_bytes must be >= 0")
        if self.int4_kernel not in INT4_KERNELS:
            raise ConfigError(f"int4_kernel must be 'auto', 'tinygemm' or 'triton', not {self.int4_kernel!r}")
        if self.buckets is not None:
            object.__setattr__(self, "buckets", tuple(self.buckets))
            if not self.buckets or min(self.buckets) < 1:
                raise ConfigError("batch buckets must be >= 1")
