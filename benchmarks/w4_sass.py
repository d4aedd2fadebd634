"""The W4A16 kernel's instructions per K block, compiled for a GPU this machine need not have.

Compiles each launch setting of convo's W4A16 kernel ahead of time for a CUDA target
(Triton's own ``ptxas``; no device), disassembles it with Triton's ``cuobjdump``, and counts
the instructions of its main loop by the unit that runs them. Per K block, one thread
dequantizes ``BLOCK_N * BLOCK_K / threads`` weights; a unit that does ``r`` instructions
per clock per SM needs ``count * threads / r`` clocks for the block, so the largest of
those bounds how many weight bytes an SM can take per clock, whatever the memory gives.
On sm_90 it also reads in the PTX whether the products' left operand stays in registers
and how many products run on while the loop goes on (:func:`wgmma`). The rates are
sm_90's (conversions 16 per clock, integer 64, float and half2 128). It is a lens for when
no GPU is at hand, not a timing: ``benchmarks/w4_kernels.py`` times them.

    python benchmarks/w4_sass.py --arch 90 --out w4_sass.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: sm_90 issue rates per SM and clock (CUDA C++ Programming Guide, arithmetic instructions).
UNIT_RATES = {"conversion": 16, "integer": 64, "float": 128}
UNITS = {
    "conversion": ("I2F", "I2FP", "F2F", "F2FP", "F2I"),
    "integer": ("IMAD", "LOP3", "PRMT", "SHF", "IADD3", "LEA", "SEL", "ISETP", "VIADD", "SGXT", "IABS"),
    "float": ("FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "HMUL2"),
}


def loop_ops(sass: str) -> Counter[str]:
    """Opcodes of the longest backward branch's body (the K loop, software pipelined)."""
    lines = re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?);", sass, re.M)
    best: list[str] = []
    for addr, ins in lines:
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < int(addr, 16):
            lo, hi = int(target.group(1), 16), int(addr, 16)
            body = [i for a, i in lines if lo <= int(a, 16) <= hi]
            best = body if len(body) > len(best) else best
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in best)


def wgmma(ptx: str) -> dict[str, Any]:
    """How the loop's sm_90 products run, read in the PTX: ``wgmma_a_in_registers`` (the
    left operand in registers, not a shared-memory descriptor) and ``wgmma_in_flight`` (the
    most products left running while the loop goes on: 0, each block waits for its own);
    ``None`` where there is no wgmma (sm_80, or mma.sync tiles)."""
    products = re.findall(r"wgmma\.mma_async[^;]*", ptx)
    if not products:
        return {"wgmma_a_in_registers": None, "wgmma_in_flight": None}
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)]
    return {
        "wgmma_a_in_registers": all(re.search(r"\},\s*\{%r", p) is not None for p in products),
        "wgmma_in_flight": max(waits, default=0),
    }


def analyse(cfg: tuple[Any, ...], arch: int, dtype: str) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from convo.fast.kernels import _W4, _w4_op, w4a16_settings

    _w4_op()
    bm, bn, split, warps, stages, bk, trans, magic, swap = w4a16_settings(cfg)
    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_szn", "stride_ym")
    sig = {"X": f"*{dtype}", "W": "*u8", "SZ": f"*{dtype}", "Y": f"*{dtype}" if split == 1 else "*fp32"}
    sig |= dict.fromkeys(ints, "i32")
    consts = {"GROUP": 32, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}
    consts |= {"TRANS": trans, "MAGIC": magic, "SWAP": swap and not trans}
    sig |= dict.fromkeys(consts, "constexpr")
    # as the JIT specializes a launch: 16-byte aligned pointers, sizes divisible by 16 (not M)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 7, 8, 9, 10)}
    src = ASTSource(fn=_W4["kernel"], signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
    )
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    ops = loop_ops(sass)
    threads = 32 * warps
    counts = {unit: sum(ops.get(o, 0) for o in names) for unit, names in UNITS.items()}
    clocks = {unit: counts[unit] * threads / UNIT_RATES[unit] for unit in counts}
    clocks["issue"] = sum(ops.values()) * warps / 4  # four schedulers an SM
    weight_bytes = bn * bk // 2
    bound = max(clocks, key=lambda u: clocks[u])
    return {
        "cfg": list(w4a16_settings(cfg)),
        "loop_instructions": sum(ops.values()),
        "per_unit": counts,
        "mma": ops.get("HMMA", 0) + ops.get("HGMMA", 0),
        **wgmma(compiled.asm["ptx"]),
        "bound_by": bound,
        "weight_bytes_per_clock_per_sm": round(weight_bytes / clocks[bound], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, as 90 for sm_90")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--rows", default="16,64,272", help="the row buckets whose candidates to compile")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from convo.fast.kernels import w4a16_candidates

    seen, results = set(), []
    for rows in (int(r) for r in args.rows.split(",")):
        for cfg in w4a16_candidates(rows):
            if len(cfg) == 1 or cfg in seen:  # the dense path has no loop of its own
                continue
            seen.add(cfg)
            row = analyse(cfg, args.arch, args.dtype)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        report = {"arch": args.arch, "dtype": args.dtype, "results": results}
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
