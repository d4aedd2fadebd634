"""benchmarks/w4_sass.py without a GPU: the W4A16 kernel compiled for sm_90 by Triton's own
tools, its K loop's instructions counted (the speed of each setting is the GPU's to say)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
needs_tools = pytest.mark.skipif(
    not (TOOLS / "ptxas").exists() or not (TOOLS / "cuobjdump").exists(),
    reason="Triton ships no CUDA tools here",
)


@pytest.fixture(scope="module")
def sass() -> ModuleType:
    spec = importlib.util.spec_from_file_location("w4_sass", ROOT / "benchmarks" / "w4_sass.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_loop_is_the_longest_backward_branch(sass: ModuleType) -> None:
    listing = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   I2F R2, R3 ;
        /*0020*/                   LOP3.LUT R4, R5, 0xf, RZ, 0xc0, !PT ;
        /*0030*/              @P0 BRA 0x10 ;
        /*0040*/                   EXIT ;
    """
    assert dict(sass.loop_ops(listing)) == {"I2F": 1, "LOP3": 1, "BRA": 1}


@needs_tools
def test_magic_2_takes_the_nibbles_to_bf16_without_conversion_units(sass: ModuleType) -> None:
    """The point of MAGIC 2: no integer-to-float conversions in the 16-row tile's loop, fewer
    integer instructions than MAGIC 1's join and casts, and a higher bound than MAGIC 0."""
    plain = sass.analyse((16, 64, 4, 4, 3, 128, False, 0), 90, "bf16")
    casts = sass.analyse((16, 64, 4, 4, 3, 128, False, 1), 90, "bf16")
    ptx = sass.analyse((16, 64, 4, 4, 3, 128, False, 2), 90, "bf16")
    assert plain["per_unit"]["conversion"] > 0 and plain["bound_by"] == "conversion"
    assert casts["per_unit"]["conversion"] == 0 and ptx["per_unit"]["conversion"] == 0
    assert ptx["per_unit"]["integer"] < casts["per_unit"]["integer"]
    assert ptx["weight_bytes_per_clock_per_sm"] > 1.5 * plain["weight_bytes_per_clock_per_sm"]
    assert ptx["mma"] == plain["mma"] > 0  # the same products, the same tensor-core work
    # PTX for sm_80 and later: fma.rn.bf16x2 (add.bf16x2 would need sm_90)
    assert sass.analyse((16, 64, 4, 4, 3, 128, False, 2), 80, "bf16")["per_unit"]["conversion"] == 0


@needs_tools
def test_swap_keeps_the_weight_tile_in_registers_and_the_product_asynchronous(sass: ModuleType) -> None:
    """The point of SWAP on sm_90: the dequantized tile is wgmma's left operand, in
    registers, and a product runs on beside the next block's dequantization; the same tile
    as the right operand goes through shared memory and each block waits for its product."""
    tall = (128, 128, 1, 8, 3, 64, False, 2)
    swapped = sass.analyse((*tall, True), 90, "bf16")
    plain = sass.analyse((*tall, False), 90, "bf16")
    assert swapped["wgmma_a_in_registers"] is True and swapped["wgmma_in_flight"] >= 1
    assert plain["wgmma_a_in_registers"] is False and plain["wgmma_in_flight"] == 0
    assert swapped["mma"] == plain["mma"] > 0
    assert sass.wgmma("mma.sync.aligned.m16n8k16") == {"wgmma_a_in_registers": None, "wgmma_in_flight": None}
