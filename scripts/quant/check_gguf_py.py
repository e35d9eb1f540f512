"""Cross-check ggml's dequantization goldens against gguf-py's numpy dequantizers.

Usage: PYTHONPATH=<llama.cpp>/gguf-py python3 check_gguf_py.py DATA_DIR
Prints, per type, the largest difference between gguf-py and ggml on the random blocks.
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

data = Path(sys.argv[1])
worst = 0.0
for binf in sorted(data.glob("rand_*.bin")):
    name = binf.stem[len("rand_"):]
    qtype = GGMLQuantizationType[name.upper()]
    raw = np.fromfile(binf, dtype=np.uint8)
    ours = np.fromfile(binf.with_suffix(".f32"), dtype=np.float32)
    with np.errstate(all="ignore"):
        theirs = quants.dequantize(raw, qtype).reshape(-1).astype(np.float32)
    finite = np.isfinite(ours) & np.isfinite(theirs)
    same_nonfinite = np.array_equal(~np.isfinite(ours), ~np.isfinite(theirs))
    # difference relative to the largest magnitude of its block (values near zero come out of
    # d·q − m, where a different operation order moves the rounding)
    block = ours.size // (raw.size // quants.GGML_QUANT_SIZES[qtype][1])
    mag = np.repeat(np.max(np.abs(np.where(np.isfinite(ours), ours, 0)).reshape(-1, block), axis=1), block)
    diff = float(np.max(np.abs(ours[finite] - theirs[finite]) / np.maximum(1e-30, mag[finite])))
    exact = int(np.sum(ours[finite].view(np.uint32) == theirs[finite].view(np.uint32)))
    print(f"{name:6s} values {ours.size:6d} bit-exact {exact:6d} max diff/block max {diff:.2e} non-finite agree {same_nonfinite}")
    worst = max(worst, diff)
if worst > 1e-6:
    sys.exit(f"gguf-py and ggml disagree (max relative difference {worst:.2e})")
print("gguf-py agrees with ggml")
