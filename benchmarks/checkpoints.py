"""Random-weight HF checkpoints of a given shape, for benchmarks (no hub access)."""

import json
from pathlib import Path


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over tokens t0..t{vocab_size-1} (t0 unknown, t1 end)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")


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
