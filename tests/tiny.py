"""Tiny checkpoints built by the independent references (transformers, tokenizers).

Weights are decisive (std 0.08, wide lm_head) so greedy ids do not hinge on
rounding; references run in fp32 torch.
"""

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    '{"name": "Alice", "age": 30, "city": "Paris"}',
    '{"name": "Bob", "age": 41, "city": "Lima", "tags": ["a", "b"]}',
    "Serve custom language models on TPUs, CPUs and GPUs with vLLM.",
] * 20


def make_tokenizer(directory: Path, vocab_size: int = 384):
    """A byte-level BPE tokenizer with Qwen-style special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def make_qwen3(directory: Path, *, structural: bool = True, tied: bool = False,
               num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
               hidden_size: int = 64, num_layers: int = 2, intermediate_size: int = 128,
               vocab_size: int = 384, max_position_embeddings: int = 8192,
               attention_bias: bool = False, seed: int = 0, dtype: str = "float32") -> Path:
    """Writes an HF Qwen3 (or Qwen3-structural) checkpoint with a tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory, vocab_size)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tied,
        attention_bias=attention_bias, initializer_range=0.08, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # non-trivial norms catch a missed scale
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
        if not tied:
            model.lm_head.weight.normal_(0, 0.3)
    model.save_pretrained(directory)
    if structural:
        generator = torch.Generator().manual_seed(seed + 1)
        tensors = load_file(directory / "model.safetensors")
        tensors["structural_head.weight"] = (
            torch.randn(hidden_size, hidden_size, generator=generator) * 0.15).to(model.dtype)
        tensors["structural_head.bias"] = (
            torch.randn(hidden_size, generator=generator) * 0.1).to(model.dtype)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((directory / "config.json").read_text())
        cfg["architectures"] = ["Qwen3StructuralForCausalLM"]
        (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


class Qwen3Reference:
    """transformers' Qwen3ForCausalLM in fp32, plus the structural head in torch."""

    def __init__(self, directory: Path):
        from transformers import Qwen3ForCausalLM

        directory = Path(directory)
        self.model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        tensors = {}
        for file in directory.glob("*.safetensors"):
            tensors.update(load_file(file))
        self.head = None
        if "structural_head.weight" in tensors:
            self.head = torch.nn.Linear(*tensors["structural_head.weight"].shape[::-1])
            self.head.load_state_dict({"weight": tensors["structural_head.weight"].float(),
                                       "bias": tensors["structural_head.bias"].float()})

    @torch.no_grad()
    def logits(self, token_ids) -> np.ndarray:
        """[L, V] next-token logits for every prefix of token_ids."""
        ids = torch.tensor([list(token_ids)])
        hidden = self.model.model(input_ids=ids).last_hidden_state  # after model.norm
        if self.head is not None:
            hidden = torch.tanh(self.head(hidden))
        return self.model.lm_head(hidden)[0].numpy()

    @torch.no_grad()
    def greedy(self, token_ids, max_tokens: int) -> list[int]:
        ids = list(token_ids)
        for _ in range(max_tokens):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(token_ids):]


def reshard(directory: Path, num_shards: int = 3) -> Path:
    """Rewrites model.safetensors as HF-style shards + model.safetensors.index.json."""
    directory = Path(directory)
    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors").unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return directory
