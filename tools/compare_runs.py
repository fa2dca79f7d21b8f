"""Compare two run directories of the same config (e.g. the same pipeline run by two versions of the code): the
evaluation's results, stage 2's curves, and every stage-1, stage-2 and export tensor, bitwise.

    .venv/bin/python -m tools.compare_runs RUN_A RUN_B
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

PATTERNS = (
    "stage1/layer_*.safetensors",
    "stage2/final/adapter/*.safetensors",
    "stage2/final/hybrid_params.safetensors",
    "export/*.safetensors",
)


def tensors(root: Path, pattern: str) -> dict[str, torch.Tensor]:
    return {f"{f.relative_to(root)}:{k}": v for f in sorted(root.glob(pattern)) for k, v in load_file(f).items()}


def main(a: Path, b: Path) -> int:
    same = True
    ra, rb = (json.loads((r / "eval" / "results.json").read_text()) for r in (a, b))
    for key in ("modes", "perplexity", "delta_la", "delta_swa", "verdict", "tasks", "la_share"):
        equal = ra.get(key) == rb.get(key)
        same &= equal
        print(f"results.json {key}: {'equal' if equal else 'DIFFERENT'}")
    for pattern in PATTERNS:
        ta, tb = tensors(a, pattern), tensors(b, pattern)
        equal = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        same &= equal
        print(f"{pattern}: {len(ta)} tensors, {'bitwise equal' if equal else 'DIFFERENT'}")
    ca, cb = (json.loads((r / "stage2" / "curves.json").read_text()) for r in (a, b))
    same &= ca == cb
    print(f"stage2/curves.json: {'equal' if ca == cb else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
