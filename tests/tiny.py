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


def check_exactly(checkpoint, expected: dict, *, optional=()) -> None:
    """Raises CheckpointError unless an HfCheckpoint holds exactly `expected` (plus `optional`)."""
    from tpu_models.loaders.hf import check_tensors
    check_tensors({n: (i.shape, i.file.name) for n, i in checkpoint.tensors.items()}, expected,
                  optional=optional, where=str(checkpoint.directory))


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
               attention_bias: bool = False, sliding_window: int | None = None,
               layer_types: list[str] | None = None, seed: int = 0,
               dtype: str = "float32") -> Path:
    """Writes an HF Qwen3 (or Qwen3-structural) checkpoint with a tokenizer;
    `layer_types` "sliding_attention" layers attend `sliding_window` tokens."""
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
        use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
        layer_types=layer_types, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
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


def make_gemma3(directory: Path, *, num_layers: int = 6, sliding_window: int = 16,
                num_heads: int = 4, num_kv_heads: int = 1, head_dim: int = 32,
                hidden_size: int = 64, intermediate_size: int = 128, vocab_size: int = 384,
                query_pre_attn_scalar: int = 24, attn_logit_softcapping: float | None = None,
                final_logit_softcapping: float | None = None, rope_scaling: dict | None = None,
                max_position_embeddings: int = 4096, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> Path:
    """Writes an HF Gemma 3 text checkpoint (5 local layers, then a global one),
    its weights stored in `dtype` (bf16 as released, or float32)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory, vocab_size)
    full = {"rope_type": "default", "rope_theta": 1_000_000.0, **(rope_scaling or {})}
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar, attn_logit_softcapping=attn_logit_softcapping,
        final_logit_softcapping=final_logit_softcapping, initializer_range=0.08,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # Gemma scales by (1 + weight)
        model.model.embed_tokens.weight.normal_(0, 0.05)
    model.to(dtype).save_pretrained(directory)
    return directory


def make_lora(base: Path, out: Path, *, targets=("q_proj", "k_proj", "v_proj", "o_proj",
              "gate_proj", "up_proj", "down_proj"), r: int = 4, alpha: float = 16,
              use_rslora: bool = False, seed: int = 0) -> Path:
    """A PEFT LoRA adapter on the base model, with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                        use_rslora=use_rslora, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return Path(out)


def _register_softcap_attention():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    def eager_softcap(module, *args, **kwargs):
        return eager_attention_forward(module, *args, softcap=module.attn_logit_softcapping, **kwargs)

    AttentionInterface.register("eager_softcap", eager_softcap)
    ALL_MASK_ATTENTION_FUNCTIONS.register("eager_softcap", eager_mask)


class Reference:
    """transformers in fp32 (Qwen3 or Gemma 3), optionally with a PEFT adapter
    merged by peft's merge_and_unload, plus the structural head in torch."""

    def __init__(self, directory: Path, adapter: Path | None = None):
        from transformers import AutoModelForCausalLM

        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        # transformers' Gemma 3 never passes attn_logit_softcapping to its attention
        # (released Gemma 3 configs leave it unset); apply it as Gemma 2 does.
        impl = "eager_softcap" if config.get("attn_logit_softcapping") else None
        if impl:
            _register_softcap_attention()
        self.model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation=impl).eval()
        if adapter is not None:
            from peft import PeftModel
            # torchax (tpu-inference's) registers a "jax" torch accelerator, which peft
            # >= 0.22 would load the adapter onto: the reference stays on the CPU.
            self.model = PeftModel.from_pretrained(
                self.model, adapter, torch_device="cpu").merge_and_unload().eval()
        tensors = {}
        for file in directory.glob("*.safetensors"):
            tensors.update(load_file(file))
        self.head = None
        if "structural_head.weight" in tensors:
            self.head = torch.nn.Linear(*tensors["structural_head.weight"].shape[::-1])
            self.head.load_state_dict({"weight": tensors["structural_head.weight"].float(),
                                       "bias": tensors["structural_head.bias"].float()})

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.no_grad()
    def logits(self, token_ids) -> np.ndarray:
        """[L, V] next-token logits for every prefix of token_ids."""
        ids = torch.tensor([list(token_ids)])
        if self.head is None:
            return self.model(input_ids=ids).logits[0].numpy()
        hidden = self.model.model(input_ids=ids).last_hidden_state  # after model.norm
        return self.model.lm_head(torch.tanh(self.head(hidden)))[0].numpy()

    @torch.no_grad()
    def greedy_cached(self, token_ids, max_tokens: int, chunk: int = 1024) -> list[int]:
        """Greedy ids through transformers' own KV cache, the prompt fed `chunk`
        tokens at a time: for prompts whose attention over the whole sequence
        at once would not fit in memory. (Gemma 3 only: no structural head.)"""
        from transformers import DynamicCache

        assert self.head is None
        cache = DynamicCache(config=self.model.config)
        pieces = [token_ids[i:i + chunk] for i in range(0, len(token_ids), chunk)]
        out = []
        for _ in range(max_tokens):
            for piece in pieces:
                logits = self.model(input_ids=torch.tensor([list(piece)]), past_key_values=cache,
                                    use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            pieces = [[out[-1]]]
        return out

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


def make_eagle3_draft(target: Path, out: Path, *, aux_layers: tuple[int, ...],
                      propose: int, seed: int = 0) -> Path:
    """An EAGLE-3 draft for `target` with random layers and a draft vocabulary
    of one token, `propose` (d2t maps it there): it always proposes `propose`,
    so a target that often emits that token accepts some drafts."""
    from tpu_models.loaders import eagle3

    target_config = json.loads((Path(target) / "config.json").read_text())
    config = eagle3.draft_config(target_config, aux_layers=aux_layers, intermediate_size=128,
                                 draft_vocab_size=1)
    rng = np.random.default_rng(seed)
    tensors = {name: (rng.normal(0, 0.05, shape) if len(shape) > 1 else 1 + rng.normal(0, 0.1, shape))
               .astype(np.float32) for name, shape in eagle3.shapes(config).items()}
    tensors["d2t"] = np.array([propose], np.int64)
    return eagle3.write_draft(out, config, tensors, tokenizer=target)
