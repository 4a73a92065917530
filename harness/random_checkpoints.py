"""Random-weight HF checkpoints of a given shape, for benchmarks (no hub access)."""

import json
from pathlib import Path


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer: <unk> 0, </s> 1 (the end), then words t2..t{vocab_size-1}.
    Its special tokens are no word's prefix: an added token is matched inside words,
    so an end token "t1" cut "t12" into "t1" + "2"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def random_gemma3(directory: Path, *, num_layers: int, vocab_size: int, seed: int = 0,
                  **shape) -> Path:
    """A Gemma 3 text checkpoint (every 6th layer global), bf16 on disk as released."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(num_hidden_layers=num_layers, vocab_size=vocab_size,
                              eos_token_id=1, bos_token_id=1, pad_token_id=0, **shape)
    config.architectures = ["Gemma3ForCausalLM"]
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    word_tokenizer(vocab_size).save_pretrained(directory)
    assert json.loads((Path(directory) / "config.json").read_text())["architectures"] == [
        "Gemma3ForCausalLM"]
    return Path(directory)


# Real shapes, random weights: costs that grow with size hide in tiny models.
SHAPES = {
    # Qwen3-0.6B, plus the structural head (tied embedding, vocabulary 151,936)
    "qwen3-0.6b": dict(arch="qwen3-structural", num_layers=28, hidden_size=1024,
                       intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151_936),
    # Qwen3-1.7B, 4B and 8B shapes (8B's embedding is not tied), compiled for TPUs only
    "qwen3-1.7b": dict(arch="qwen3-structural", num_layers=28, hidden_size=2048,
                       intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151_936),
    "qwen3-4b": dict(arch="qwen3-structural", num_layers=36, hidden_size=2560,
                     intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151_936),
    "qwen3-8b": dict(arch="qwen3-structural", num_layers=36, hidden_size=4096,
                     intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151_936, tie_word_embeddings=False),
    # Gemma 3 1B (26 layers, 22 local with window 512, vocabulary 262,144)
    "gemma3-1b": dict(arch="gemma3", num_layers=26, hidden_size=1152, intermediate_size=6912,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      sliding_window=512, query_pre_attn_scalar=256, vocab_size=262_144,
                      max_position_embeddings=32768),
    # Gemma 3 4B and 27B (text), Qwen3 32B: compiled for TPUs only (rope scaling left out:
    # it changes no shape)
    "gemma3-4b": dict(arch="gemma3", num_layers=34, hidden_size=2560, intermediate_size=10240,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      sliding_window=1024, query_pre_attn_scalar=256, vocab_size=262_208,
                      max_position_embeddings=131072),
    "gemma3-27b": dict(arch="gemma3", num_layers=62, hidden_size=5376, intermediate_size=21504,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                       sliding_window=1024, query_pre_attn_scalar=168, vocab_size=262_208,
                       max_position_embeddings=131072),
    "qwen3-32b": dict(arch="qwen3-structural", num_layers=64, hidden_size=5120,
                      intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, vocab_size=151_936, tie_word_embeddings=False),
}


def random_qwen3_structural(directory: Path, *, num_layers: int, vocab_size: int, seed: int = 0,
                            **shape) -> Path:
    """A Qwen3-structural checkpoint (structural head beside Qwen3's), bf16 on disk."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(num_hidden_layers=num_layers, vocab_size=vocab_size,
                         tie_word_embeddings=True, eos_token_id=1, bos_token_id=1, **shape)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    word_tokenizer(vocab_size).save_pretrained(directory)
    add_structural_head(Path(directory), torch.bfloat16)
    return Path(directory)


def add_structural_head(directory: Path, dtype=None) -> None:
    """Turns a transformers Qwen3 checkpoint into a Qwen3-structural one: a random
    structural head (std 0.02, zero bias) beside its tensors, and our architecture
    in config.json (save_pretrained wrote transformers' class name)."""
    import torch
    from safetensors.torch import load_file, save_file

    dtype = dtype or torch.float32
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    width = config["hidden_size"]
    tensors["structural_head.weight"] = (torch.randn(width, width) * 0.02).to(dtype)
    tensors["structural_head.bias"] = torch.zeros(width, dtype=dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    config["architectures"] = ["Qwen3StructuralForCausalLM"]
    config_path.write_text(json.dumps(config, indent=2))


def random_checkpoint(shape: str, directory: Path) -> Path:
    """A checkpoint of one of SHAPES, random weights, bf16 on disk as released."""
    fields = dict(SHAPES[shape])
    make = {"qwen3-structural": random_qwen3_structural, "gemma3": random_gemma3}[fields.pop("arch")]
    return make(Path(directory), **fields)


def shape_config(shape: str, **overrides) -> dict:
    """config.json of one of SHAPES, with `overrides` of its fields (num_layers,
    vocab_size, ...), for `--load-format dummy`: no weights written."""
    from transformers import Gemma3TextConfig, Qwen3Config

    fields = dict(SHAPES[shape]) | {k: v for k, v in overrides.items() if v is not None}
    arch, layers = fields.pop("arch"), fields.pop("num_layers")
    if arch == "gemma3":
        config = Gemma3TextConfig(num_hidden_layers=layers, **fields).to_dict()
        return config | {"architectures": ["Gemma3ForCausalLM"]}
    fields.setdefault("tie_word_embeddings", True)
    config = Qwen3Config(num_hidden_layers=layers, **fields).to_dict()
    return config | {"architectures": ["Qwen3StructuralForCausalLM"]}
