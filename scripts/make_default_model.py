"""Writes the embedded default model (server/default_model): a tiny random
Qwen3-structural with a byte-level BPE tokenizer and chat template.

Placeholder until the trained JSON demo replaces it; run from the repo root:
    .venv/bin/python scripts/make_default_model.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.tiny import make_qwen3  # noqa: E402

if __name__ == "__main__":
    out = Path(__file__).parents[1] / "server" / "default_model"
    make_qwen3(out, tied=False, num_heads=4, num_kv_heads=2, max_position_embeddings=4096)
    print(f"wrote {out}")
