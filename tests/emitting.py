"""Tiny checkpoints trained to emit given replies: reasoning tags, tool calls.

A byte-level BPE tokenizer is trained on the very texts (markup listed in `added`
becomes one token each, as in Qwen3's vocabulary; the rest stays plain text, as
Tunix's tags are to Gemma's), then a 2-layer model memorises each prompt -> reply
in fp32 torch until every reply token wins by a margin, and is saved as HF
safetensors. `Reference(directory).greedy` (tests/tiny.py) reproduces the replies.
"""

import contextlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EOS, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML; the tools a request offers are listed by name only, so that the prompt the
# server renders cannot differ from the one trained on in how it spells a schema.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MARGIN = 2.0  # logits by which each reply token must beat the runner-up


def make_tokenizer(directory: Path, texts: list[str], added: tuple[str, ...] = (),
                   vocab_size: int = 320):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, TURN_START, TURN_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # Not special: they stay in the detokenized text, where the parsers look for them.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def prompt_ids(tokenizer, example: dict) -> list[int]:
    """The prompt as vLLM's chat endpoint renders it."""
    return tokenizer.apply_chat_template(example["messages"], tools=example.get("tools"),
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def sequences(tokenizer, examples: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids + EOS) per example."""
    return [(prompt_ids(tokenizer, e),
             tokenizer.encode(e["reply"], add_special_tokens=False) + [tokenizer.eos_token_id])
            for e in examples]


def memorise(logits_fn, parameters, data, *, steps: int = 3000, lr: float = 3e-3) -> int:
    """Adam on the reply tokens only, until each is the argmax by MARGIN; returns the
    steps taken. `logits_fn(ids [B, L]) -> [B, L, V]`."""
    eos = data[0][1][-1]
    length = max(len(p) + len(r) for p, r in data)
    ids = torch.full((len(data), length), eos)
    targets = torch.full((len(data), length), -100)
    for row, (prompt, reply) in enumerate(data):
        ids[row, :len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        targets[row, len(prompt) - 1:len(prompt) + len(reply) - 1] = torch.tensor(reply)
    optimizer = torch.optim.Adam(parameters, lr=lr)
    mask, chosen = targets != -100, targets.clamp(min=0)[..., None]
    with one_thread():
        for step in range(steps):
            logits = logits_fn(ids)
            if step % 25 == 0:
                with torch.no_grad():
                    rival = logits.scatter(-1, chosen, -1e9).amax(-1)
                    if bool(((logits.gather(-1, chosen)[..., 0] - rival)[mask] > MARGIN).all()):
                        return step
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    raise AssertionError(f"replies not memorised in {steps} steps (loss {float(loss):.3f})")


@contextlib.contextmanager
def one_thread():
    """Tiny matmuls: on a 2-core host threads only contend (8x slower per step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def training_texts(examples: list[dict]) -> list[str]:
    texts = [e["reply"] for e in examples]
    texts += [m["content"] for e in examples for m in e["messages"]]
    return texts * 8


def make_qwen3_structural(directory: Path, examples: list[dict], added=(), seed: int = 0) -> Path:
    """A Qwen3StructuralForCausalLM (structural head trained with the rest) emitting each
    example's "reply" to its "messages" (and "tools")."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    tokenizer = make_tokenizer(directory, training_texts(examples), added)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    head = torch.nn.Linear(64, 64)

    def logits(ids):
        hidden = model.model(input_ids=ids).last_hidden_state
        return model.lm_head(torch.tanh(head(hidden)))

    memorise(logits, [*model.parameters(), *head.parameters()], sequences(tokenizer, examples))
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["structural_head.weight"] = head.weight.detach().clone()
    tensors["structural_head.bias"] = head.bias.detach().clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config_file = directory / "config.json"
    config_json = json.loads(config_file.read_text())
    config_json["architectures"] = ["Qwen3StructuralForCausalLM"]
    config_file.write_text(json.dumps(config_json, indent=2))
    return directory


def make_gemma3(directory: Path, examples: list[dict], added=(), seed: int = 0) -> Path:
    """A Gemma 3 text model (a local layer, then a global one) emitting each example's reply."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    directory = Path(directory)
    tokenizer = make_tokenizer(directory, training_texts(examples), added)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=32, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    memorise(lambda ids: model(input_ids=ids).logits, list(model.parameters()),
             sequences(tokenizer, examples))
    model.save_pretrained(directory)
    return directory
