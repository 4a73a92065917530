"""Builds the tiny checkpoints `tpu-models doctor` serves, and the greedy tokens
transformers (fp32) gives for them: server/doctor_models/.

Qwen3-structural (2 layers) and Gemma 3 (5 sliding-window layers of 16 tokens,
then a global one; attention and final soft caps), each with a tokenizer. The
prompts are kept only where every greedy step wins by a clear margin (top-1
minus top-2 logit), so a TPU computing fp32 matmuls in bf16 passes still picks
the same tokens: a mismatch then means a wrong path, not rounding.
Run from the repo root (seconds):
    ./dev python scripts/make_doctor_models.py
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.tiny import Reference, make_gemma3, make_qwen3  # noqa: E402

OUT = ROOT / "server" / "doctor_models"
TOKENS = 8  # greedy tokens per prompt
MARGIN = 0.3  # least top-1 minus top-2 logit at every step
# Prompt lengths: a decode-sized one, one a window long, prompts several windows
# long (chunked prefill at the doctor's 32-token chunks).
LENGTHS = (3, 17, 45, 90)


def sharpen(directory: Path, name: str, change) -> None:
    """Widens the logits (the test models' are near-tied past a few tokens)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(directory / "model.safetensors")
    tensors[name] = change(tensors[name])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def margins(reference: Reference, prompt: list[int]) -> tuple[list[int], float]:
    ids = list(prompt)
    least = np.inf
    for _ in range(TOKENS):
        row = reference.logits(ids)[-1]
        second, first = np.sort(row)[-2:]
        least = min(least, float(first - second))
        ids.append(int(row.argmax()))
    return ids[len(prompt):], least


def prompts_for(reference: Reference, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    chosen = {"prompts": [], "greedy": [], "margins": []}
    for length in LENGTHS:
        for _ in range(500):
            prompt = rng.integers(3, reference.vocab_size, length).tolist()
            greedy, least = margins(reference, prompt)
            if least >= MARGIN:
                break
        else:
            raise SystemExit(f"no prompt of {length} tokens with margin {MARGIN}")
        chosen["prompts"].append(prompt)
        chosen["greedy"].append(greedy)
        chosen["margins"].append(round(least, 3))
    return chosen


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    models = {
        "qwen3-structural": make_qwen3(OUT / "qwen3-structural"),
        "gemma3": make_gemma3(OUT / "gemma3", sliding_window=16, attn_logit_softcapping=30.0,
                              final_logit_softcapping=20.0),
    }
    sharpen(models["qwen3-structural"], "lm_head.weight", lambda w: 3 * w)
    sharpen(models["gemma3"], "model.norm.weight", lambda w: w + 3)  # Gemma scales by 1 + w
    expected = {"about": "greedy ids of transformers fp32 (scripts/make_doctor_models.py)",
                "tokens": TOKENS, "min_margin": MARGIN}
    for seed, (name, directory) in enumerate(models.items()):
        expected[name] = prompts_for(Reference(directory), seed)
        print(name, "margins", expected[name]["margins"])
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
