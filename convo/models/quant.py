"""Weight formats: :class:`Quant`, one enum for the engines and the memory planner, and the
facts of convo's int4 grid (group sizes, the default group, the rule that picks a group for
a weight shape, the kernel choices).

Two defaults, because two kinds of caller ask:

* :data:`INT4_GROUP_SIZE` (32) is what the engine (``TransformersEngine(int4_group_size=)``,
  ``convo serve --quant int4``) quantizes with and what the planner prices
  (``convo plan --quant int4``);
* the kernel-level building blocks (:meth:`convo.fast.int4.Int4Linear.quantize`,
  :class:`convo.fast.decoder.StaticDecoder`, :func:`int4_group_size`) default to the
  largest group the kernels accept, :data:`INT4_GROUP_SIZES` ``[0]`` (128: the fewest bytes
  per token), and fall back to smaller groups where a shape needs it.
"""

from __future__ import annotations

import enum

from convo.errors import ConfigError


class Quant(enum.StrEnum):
    """Weight format, one enum for the engines and the memory planner.

    ``AUTO`` (the engine's default) is ``NF4`` on CUDA, where weights compete with the KV
    cache for memory, and ``FP32`` on CPU, where host memory is rarely the limit and both
    bitsandbytes' 4-bit kernels and bf16 matrix products run several times slower than
    fp32 on CPUs without bf16 matrix units (measured on the CI machine: SmolLM2-135M
    prefill of 1,000 tokens 11.5 s fp32 vs 31.7 s bf16; a decode step 0.27 s vs 1.9 s).
    Ask for ``NF4`` to get 4-bit on CPU. ``NF4`` is bitsandbytes NormalFloat-4 with double
    quantization and bf16 compute on CUDA (fp16 where bf16 is unsupported; fp32 on CPU).
    ``FP4`` is bitsandbytes' other 4-bit type (the planner prices it; the engine loads nf4).

    ``INT4`` is the fast 4-bit path: group-wise int4 (group :data:`INT4_GROUP_SIZE`) held by
    :class:`convo.fast.int4.Int4Linear` (PyTorch's tinygemm layout and a plain one for
    convo's Triton kernel, see :data:`INT4_KERNELS`), run by the static decoder
    (:mod:`convo.fast`), whose compiled, graph-captured step these kernels fit into. The
    model is loaded dense (bf16 on CUDA, fp32 on CPU) and quantized at load; it needs
    ``kv_slots`` > 0 (the default for it). On CPU its kernel runs float32 activations in
    bfloat16 (PyTorch's vectorized form; SmolLM2-135M on 2 cores: 26.9 tok/s against
    fp32's 18.6).

    ``NONE`` is no quantization: dense weights in the checkpoint's own dtype on the planner
    (the ``convo plan`` default), bf16 on CUDA and fp32 on CPU in the engine. ``BF16``,
    ``FP16`` and ``FP32`` are dense in that dtype.

    :meth:`parse` also takes ``None``, any case and torch spellings (``"bfloat16"``).
    """

    AUTO = "auto"
    NF4 = "nf4"
    INT8 = "int8"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    INT4 = "int4"
    NONE = "none"
    FP4 = "fp4"

    @classmethod
    def parse(cls, value: str | Quant | None) -> Quant:
        """``None``/``""`` -> ``NONE``; ``"NF4"``, ``"bfloat16"``, ``"float32"``... accepted.

        Raises:
            ConfigError: unknown format.
        """
        if isinstance(value, Quant):
            return value
        key = "" if value is None else str(value).strip().lower().removeprefix("torch.")
        key = _QUANT_ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ConfigError(
                f"unknown weight format {value!r}; use one of {[q.value for q in cls]}"
            ) from None

    def resolved(self, *, cuda: bool) -> Quant:
        """``AUTO`` made concrete for the device (``NF4`` on CUDA, ``FP32`` elsewhere);
        any other format as it is."""
        if self is Quant.AUTO:
            return Quant.NF4 if cuda else Quant.FP32
        return self

    @property
    def is_dense(self) -> bool:
        """No quantization: ``NONE``, ``BF16``, ``FP16``, ``FP32``."""
        return self in (Quant.NONE, Quant.BF16, Quant.FP16, Quant.FP32)

    @property
    def is_bitsandbytes(self) -> bool:
        """Quantized by bitsandbytes at load (``NF4``, ``FP4``, ``INT8``): the engine runs
        these through transformers' ``generate`` or calls the modules as loaded."""
        return self in (Quant.NF4, Quant.FP4, Quant.INT8)

    @property
    def dense_dtype(self) -> str | None:
        """``"bf16"``/``"fp16"``/``"fp32"`` for those dense formats, else ``None``."""
        return self.value if self in (Quant.BF16, Quant.FP16, Quant.FP32) else None

    @property
    def bits_per_weight(self) -> int | None:
        """Nominal storage bits of a quantized ``nn.Linear`` weight, before per-block
        scales (4 or 8; 16/32 for dense dtypes), or ``None`` (``AUTO``, ``NONE``: it
        depends). The exact bytes come from :func:`convo.planner.weights.weight_bytes`."""
        return _QUANT_BITS.get(self)


_QUANT_ALIASES = {
    "": "none",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}
_QUANT_BITS = {
    Quant.NF4: 4,
    Quant.FP4: 4,
    Quant.INT4: 4,
    Quant.INT8: 8,
    Quant.BF16: 16,
    Quant.FP16: 16,
    Quant.FP32: 32,
}


#: Group sizes (input features per scale/zero pair) convo's int4 kernels accept, largest first.
INT4_GROUP_SIZES = (128, 64, 32)
#: Input features per int4 scale/zero pair that :class:`~convo.engines.local.engine.TransformersEngine`
#: (and so ``convo serve --quant int4``) uses by default; ``convo plan --quant int4`` prices it.
#: 32 is the block of GGUF Q4_0/Q4_1, so a model that comes from such a file keeps its grid.
INT4_GROUP_SIZE = 32
#: The group the kernel-level int4 building blocks prefer when not told: the largest.
LARGEST_INT4_GROUP_SIZE = INT4_GROUP_SIZES[0]
#: The int4 kernel choices (``TransformersEngine(int4_kernel=)``, ``--int4-kernel``): which
#: weight layouts are kept. ``auto``: both on CUDA with Triton (tinygemm for a few rows,
#: Triton above; twice the weight bytes), else tinygemm's; ``triton``: the plain layout
#: alone; ``tinygemm``: PyTorch's alone.
INT4_KERNELS = ("auto", "triton", "tinygemm")


def int4_group_size(in_features: int, preferred: int = LARGEST_INT4_GROUP_SIZE) -> int | None:
    """The group size the int4 path uses for a weight of ``in_features`` inputs: the largest
    of :data:`INT4_GROUP_SIZES` that is <= ``preferred`` and divides ``in_features`` (which
    must be a multiple of 32), or ``None`` when none does (the weight then stays dense).
    :mod:`convo.fast.int4` quantizes by this rule and :mod:`convo.planner` counts its bytes
    by it."""
    for gs in INT4_GROUP_SIZES:
        if gs <= preferred and in_features % gs == 0 and in_features % 32 == 0:
            return gs
    return None


def check_int4_group_size(group_size: int, *, name: str = "int4 group_size") -> int:
    """``group_size`` if the kernels accept it (:data:`INT4_GROUP_SIZES`); ``name`` is how
    the error message calls it.

    Raises:
        ConfigError: any other value.
    """
    if group_size not in INT4_GROUP_SIZES:
        *rest, last = sorted(INT4_GROUP_SIZES)
        sizes = ", ".join(str(g) for g in rest) + f" or {last}"
        raise ConfigError(f"{name} must be {sizes}, not {group_size!r}")
    return group_size
