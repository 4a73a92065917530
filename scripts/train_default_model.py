"""Trains the embedded demo model: a 3.5M-parameter Qwen3-structural that answers in JSON.

The whole path the product serves, in miniature:
  1. synthetic requests -> JSON answers (scripts/demo_phrasing.py: freely
     phrased, and a share of scripts/demo_data.py's templates), a byte-level
     BPE tokenizer trained on them (`tokenizers`) with a chat template;
  2. a Qwen3-structural decoder trained on CPU with JAX/Optax, its parameters
     laid out as MaxText's unscanned Linen tree (token_embedder, decoder/
     layers_{i}/self_attention/query/kernel [D, N, H], ..., decoder/
     structural_head/{kernel, bias}) and saved with orbax like a MaxText run;
  3. `tpu-models export maxtext` of that checkpoint -> server/default_model,
     which `tpu-models serve` serves by default.

The forward pass below follows HF Qwen3 semantics (RMSNorm, q/k norms, RoPE
rotate-half, GQA, SwiGLU) plus the structural head, so the exported model is
the trained one. Run from the repo root (about 52 minutes on 2 idle CPU cores;
`--data templates --steps 800`, 20 minutes, is the 2M-parameter template-only demo
shipped before):
    ./dev python scripts/train_default_model.py [--steps 2200] [--out server/default_model]
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from demo_data import TRAIN_SEED, TRAIN_SIZE, dataset  # noqa: E402 (beside this script)

CONFIG = dict(vocab=512, hidden=192, layers=4, heads=6, kv_heads=2, head_dim=32, mlp=576,
              rope_theta=10000.0, eps=1e-6, max_len=96, space_apart=False)
# --data free: freely phrased requests (scripts/demo_phrasing.py) beside the templates,
# longer sentences, names in many scripts' Latin letters: more vocabulary, width and length.
FREE_CONFIG = dict(CONFIG, vocab=1024, hidden=256, heads=8, mlp=768, max_len=160,
                   space_apart=True)
FREE_SIZE, FREE_SEED, TEMPLATE_SHARE = 60000, 0, 0.25
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def training_examples(data: str) -> list[dict]:
    """The demo's training set; "free" also sizes CONFIG for it."""
    examples = dataset(TRAIN_SIZE, TRAIN_SEED)
    if data == "templates":
        return examples
    from demo_phrasing import free_dataset
    CONFIG.update(FREE_CONFIG)
    rng = np.random.default_rng(FREE_SEED)
    kept = [examples[i] for i in rng.permutation(len(examples))[:int(FREE_SIZE * TEMPLATE_SHARE)]]
    examples = free_dataset(FREE_SIZE, FREE_SEED) + kept
    # Accented names answer as written, not as \u escapes the model would have to learn.
    return [{**e, "answer": json.dumps(e["record"], ensure_ascii=False)} for e in examples]


def train_tokenizer(examples, directory: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if CONFIG["space_apart"]:
        # A space is a token of its own, so a value is the same tokens in the request
        # (" Wanjiru Kamau,") as in the answer ("\"Wanjiru Kamau\""): copying it is
        # repeating tokens, not mapping "ĠKamau" onto "Kamau" for every word.
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = [e["request"] for e in examples] + [e["answer"] for e in examples]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=CONFIG["vocab"], special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def encode(tokenizer, examples):
    """Chat-formatted ids and a mask over the answer (+ <|im_end|>): what the loss sees."""
    L = CONFIG["max_len"]
    ids = np.full((len(examples), L), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((len(examples), L), np.float32)
    for row, e in enumerate(examples):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": e["request"]}],
                                               add_generation_prompt=True, return_dict=False)
        answer = tokenizer(e["answer"])["input_ids"] + [tokenizer.eos_token_id]
        seq = (prompt + answer)[:L]
        ids[row, :len(seq)] = seq
        mask[row, len(prompt) - 1:len(seq) - 1] = 1.0  # positions that predict the answer
    return ids, mask


# --- the model, in MaxText's unscanned parameter layout --------------------------


def init_params(key):
    c = CONFIG
    D, N, K, H, F, V = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["mlp"], c["vocab"]
    keys = iter(jax.random.split(key, 64))

    def normal(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

    layers = {}
    for i in range(c["layers"]):
        layers[f"layers_{i}"] = {
            "pre_self_attention_layer_norm": {"scale": jnp.ones(D)},
            "post_self_attention_layer_norm": {"scale": jnp.ones(D)},
            "self_attention": {
                "query": {"kernel": normal((D, N, H), D)},
                "key": {"kernel": normal((D, K, H), D)},
                "value": {"kernel": normal((D, K, H), D)},
                "out": {"kernel": normal((N, H, D), N * H) / math.sqrt(2 * c["layers"])},
                "query_norm": {"scale": jnp.ones(H)},
                "key_norm": {"scale": jnp.ones(H)},
            },
            "mlp": {"wi_0": {"kernel": normal((D, F), D)}, "wi_1": {"kernel": normal((D, F), D)},
                    "wo": {"kernel": normal((F, D), F) / math.sqrt(2 * c["layers"])}},
        }
    return {
        "token_embedder": {"embedding": normal((V, D), 1.0)},
        "decoder": {**layers, "decoder_norm": {"scale": jnp.ones(D)},
                    "structural_head": {"kernel": normal((D, D), D), "bias": jnp.zeros(D)},
                    "logits_dense": {"kernel": normal((D, V), D)}},
    }


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + CONFIG["eps"]) * scale


def rope(x, positions):
    half = CONFIG["head_dim"] // 2
    inv_freq = 1.0 / CONFIG["rope_theta"]**(jnp.arange(0, half, dtype=jnp.float32) / half)
    angles = positions[:, :, None] * inv_freq  # [B, T, H/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def forward(params, ids):
    """ids [B, T] -> logits [B, T, V] (HF Qwen3 + structural head)."""
    c = CONFIG
    B, T = ids.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (B, T))
    causal = jnp.tril(jnp.ones((T, T), bool))
    x = params["token_embedder"]["embedding"][ids]  # [B, T, D]
    for i in range(c["layers"]):
        p = params["decoder"][f"layers_{i}"]
        a = p["self_attention"]
        h = rms_norm(x, p["pre_self_attention_layer_norm"]["scale"])
        q = rms_norm(jnp.einsum("btd,dnh->btnh", h, a["query"]["kernel"]), a["query_norm"]["scale"])
        k = rms_norm(jnp.einsum("btd,dkh->btkh", h, a["key"]["kernel"]), a["key_norm"]["scale"])
        v = jnp.einsum("btd,dkh->btkh", h, a["value"]["kernel"])
        q, k = rope(q, positions), rope(k, positions)
        group = c["heads"] // c["kv_heads"]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(c["head_dim"])
        scores = jnp.where(causal, scores, -1e30)
        o = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("btnh,nhd->btd", o, a["out"]["kernel"])
        h = rms_norm(x, p["post_self_attention_layer_norm"]["scale"])
        m = p["mlp"]
        gated = jax.nn.silu(h @ m["wi_0"]["kernel"]) * (h @ m["wi_1"]["kernel"])
        x = x + gated @ m["wo"]["kernel"]
    d = params["decoder"]
    h = rms_norm(x, d["decoder_norm"]["scale"])
    h = jnp.tanh(h @ d["structural_head"]["kernel"] + d["structural_head"]["bias"])
    return h @ d["logits_dense"]["kernel"]


def loss_fn(params, ids, mask):
    logits = forward(params, ids[:, :-1])
    targets = ids[:, 1:]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    m = mask[:, :-1]
    return (nll * m).sum() / m.sum()


def train(ids, mask, steps, batch, pad_id, seed=0):
    params = init_params(jax.random.PRNGKey(seed))
    warmup = min(100, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup, steps, 3e-5)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, ids, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, mask)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(seed)
    start = time.time()
    for i in range(steps):
        rows = rng.integers(0, len(ids), batch)
        # Trim to the longest sequence in the batch: less work, same result.
        length = int((ids[rows] != pad_id).sum(1).max()) + 1
        length = min(CONFIG["max_len"], -(-length // 8) * 8)
        params, state, loss = step(params, state, jnp.asarray(ids[rows, :length]),
                                   jnp.asarray(mask[rows, :length]))
        if i % 100 == 0 or i == steps - 1:
            print(f"step {i:5d}  loss {float(loss):.4f}  {time.time() - start:6.0f}s", flush=True)
    return params


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "server" / "default_model"))
    parser.add_argument("--data", choices=["templates", "free"], default="free",
                        help="free: freely phrased requests and a share of the templates (the "
                             "shipped demo); templates: demo_data's 12 templates only")
    args = parser.parse_args()

    examples = training_examples(args.data)
    work = Path(tempfile.mkdtemp(prefix="demo-train-"))
    tokenizer = train_tokenizer(examples, work / "tokenizer")
    ids, mask = encode(tokenizer, examples)
    cut = int((ids[:, -1] != tokenizer.pad_token_id).sum())  # reached max_len: maybe cut short
    print(f"{len(examples)} examples, {int(mask.sum())} answer tokens, {cut} at max_len; "
          f"tokenizer: {len(tokenizer)}")
    params = train(ids, mask, args.steps, args.batch, tokenizer.pad_token_id)

    import orbax.checkpoint as ocp

    from tpu_models.loaders.exporter.convert import maxtext
    from tpu_models import registry
    run = work / "maxtext-run"
    ocp.PyTreeCheckpointer().save((run / "checkpoints" / str(args.steps) / "items").absolute(),
                                  {"params": {"params": jax.tree.map(np.asarray, params)}})
    c = CONFIG
    out = maxtext(run, registry.by_export_name("qwen3-structural"), args.out,
                  tokenizer=work / "tokenizer", overwrite=True,
                  overrides={"rope_parameters": {"rope_type": "default",
                                                 "rope_theta": c["rope_theta"]},
                             "max_position_embeddings": 1024, "rms_norm_eps": c["eps"],
                             "eos_token_id": [tokenizer.eos_token_id,
                                              tokenizer.convert_tokens_to_ids("<|endoftext|>")]})
    generation = json.loads((out / "generation_config.json").read_text())
    generation["eos_token_id"] = json.loads((out / "config.json").read_text())["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    shutil.rmtree(work)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
