"""docs/export.md's "Try it" block, run as printed: the example checkpoints `tpu-models
export examples` writes from the demo, exported back. MaxText's and Tunix's full
weights come back as the demo's tensors, exactly; the Tunix LoRA run merged equals
peft's merge of the exported adapter."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

ROOT = Path(__file__).parents[1]
DEMO = ROOT / "server" / "default_model"


def documented_block() -> list[str]:
    text = (ROOT / "docs" / "export.md").read_text()
    section = text.split("## Try it", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    return [line for line in block.splitlines() if line.strip()]


def tensors(directory: Path) -> dict[str, np.ndarray]:
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def test_the_documented_examples_run_and_export_back(tmp_path):
    bin_dir = Path(sys.executable).parent  # tpu-models, as installed beside this Python
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    for line in documented_block():
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"{line}\n{done.stderr[-2000:]}"
    try_dir = tmp_path / "try"
    demo = tensors(DEMO)
    for exported in ("from-maxtext", "from-scanned"):
        got = tensors(try_dir / exported)
        assert got.keys() == demo.keys(), exported
        for name, array in demo.items():
            np.testing.assert_array_equal(got[name], array, err_msg=f"{exported}: {name}")
    base = tensors(try_dir / "qwen3-base")
    assert base.keys() == {k for k in demo if not k.startswith("structural_head.")}
    full = tensors(try_dir / "from-tunix")
    assert full.keys() == base.keys()
    for name, array in base.items():
        np.testing.assert_array_equal(full[name], array, err_msg=name)
    # The LoRA run: peft's merge of the exported adapter into the base, in float32.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(try_dir / "qwen3-base", dtype=torch.float32)
    merged_by_peft = PeftModel.from_pretrained(  # on the CPU, not torchax's "jax" device
        model, try_dir / "tunix-adapter", torch_device="cpu").merge_and_unload()
    reference = {k: v.numpy() for k, v in merged_by_peft.state_dict().items()}
    merged = tensors(try_dir / "tunix-merged")
    changed = 0
    for name, array in merged.items():
        # one fp32 matmul of rank 4 and one addition each way: a few ulps of the weight
        np.testing.assert_allclose(array, reference[name], rtol=1e-6, atol=1e-6, err_msg=name)
        changed += not np.array_equal(array, base[name])
    assert changed == 7 * 4  # every projection of the 4 layers
