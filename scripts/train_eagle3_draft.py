"""Trains the EAGLE-3 draft of the embedded demo model (server/default_model_eagle3).

The draft learns from the demo model's own hidden states on the demo's
training distribution (the requests the demo was trained on: --data), as tpu-inference's Eagle3 Llama draft will run it:

  step 1, at position t: h = fc([a1_t, a2_t, a3_t]) (the target's inputs of
    layers AUX_LAYERS at t, from transformers), token x_{t+1}:
      r = h + attn([norm(embed(x_{t+1})), norm(h)])     (causal over positions)
      r = r + mlp(norm(r));  logits = lm_head(norm(r))  -> x_{t+2}
  step s = 2..DRAFT_STEPS, at position t+s-1: h = step s-1's pre-norm output r,
    token x_{t+s}, attending to step 1's keys up to t and to its own chain's
    keys of steps 2..s -> x_{t+s+1} (training-time test: the draft sees its
    own hidden states, as when it drafts its 2nd, 3rd... token).

The embedding is the target's (the engine lends it to the draft). The loss
counts the answer tokens only: the draft runs while the model answers.
Run from the repo root (about 18 minutes on 2 CPU cores):
    ./dev python scripts/train_eagle3_draft.py [--steps 1200] [--examples 6000]
        [--out server/default_model_eagle3]
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from tpu_models.loaders import eagle3  # noqa: E402
from train_default_model import encode, training_examples  # noqa: E402  (scripts/, beside this one)

ROOT = Path(__file__).parents[1]
TARGET = ROOT / "server" / "default_model"
AUX_LAYERS = (1, 2, 3)  # inputs of these layers of the 4-layer demo (vLLM's default repeats one)
EXAMPLES = 6000  # of the demo's training set: their hidden states are kept in memory
DRAFT_STEPS = 4  # draft positions trained (training-time test): tokens a step can propose


def target_features(examples, target: Path):
    """Token ids [B, T], the target's auxiliary hidden states [B, T, 3D] and
    embedding table [V, D] (transformers, float32), and the loss mask [B, T]
    over positions t whose x_{t+2} is an answer token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids, predicts_answer = encode(tokenizer, examples)  # as the demo was trained
    mask = np.zeros_like(predicts_answer)
    mask[:, :-1] = predicts_answer[:, 1:]  # position t drafts x_{t+2}
    aux = np.zeros((*ids.shape, len(AUX_LAYERS) * model.config.hidden_size), np.float32)
    with torch.no_grad():
        for start in range(0, len(examples), 64):
            out = model.model(input_ids=torch.tensor(ids[start:start + 64]), output_hidden_states=True)
            # hidden_states[i] is layer i's input (0: the embeddings).
            aux[start:start + 64] = torch.cat([out.hidden_states[i] for i in AUX_LAYERS], -1).numpy()
        embedding = model.model.embed_tokens.weight.numpy().copy()
    return ids, aux, embedding, mask, json.loads((target / "config.json").read_text())


def init_params(config, key):
    shapes = eagle3.shapes(config)
    keys = iter(jax.random.split(key, len(shapes)))
    params = {}
    for name, shape in shapes.items():
        if name == "d2t":
            continue
        if len(shape) == 1:
            params[name] = jnp.ones(shape)
        else:  # HF [out, in]
            params[name] = jax.random.normal(next(keys), shape) / math.sqrt(shape[1])
    return params


def rms_norm(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x, positions, theta, head_dim):
    half = head_dim // 2
    inv_freq = 1.0 / theta**(jnp.arange(0, half, dtype=jnp.float32) / half)
    angles = positions[..., None] * inv_freq  # [B, T, H/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def layer_inputs(p, config, embeds, hidden, positions):
    """q, k, v [B, T, heads, H] of the draft layer, and its residual [B, T, D]."""
    eps, N, K, H = (config["rms_norm_eps"], config["num_attention_heads"],
                    config["num_key_value_heads"], config["head_dim"])
    x = jnp.concatenate([rms_norm(embeds, p["midlayer.input_layernorm.weight"], eps),
                         rms_norm(hidden, p["midlayer.hidden_norm.weight"], eps)], -1)  # [B, T, 2D]
    B, T, _ = x.shape
    q = (x @ p["midlayer.self_attn.q_proj.weight"].T).reshape(B, T, N, H)
    k = (x @ p["midlayer.self_attn.k_proj.weight"].T).reshape(B, T, K, H)
    v = (x @ p["midlayer.self_attn.v_proj.weight"].T).reshape(B, T, K, H)
    theta = config["rope_theta"]
    q, k = rope(q, positions, theta, H), rope(k, positions, theta, H)
    group = N // K
    return q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), hidden


def layer_output(p, config, attn, residual):
    """Attention output [B, T, N, H] -> (logits [B, T, V], pre-norm hidden [B, T, D])."""
    eps = config["rms_norm_eps"]
    B, T = attn.shape[:2]
    r = residual + attn.reshape(B, T, -1) @ p["midlayer.self_attn.o_proj.weight"].T
    h = rms_norm(r, p["midlayer.post_attention_layernorm.weight"], eps)
    gated = jax.nn.silu(h @ p["midlayer.mlp.gate_proj.weight"].T) * (h @ p["midlayer.mlp.up_proj.weight"].T)
    r = r + gated @ p["midlayer.mlp.down_proj.weight"].T
    return rms_norm(r, p["norm.weight"], eps) @ p["lm_head.weight"].T, r


def loss_fn(p, config, embedding, ids, aux, mask):
    B, T = ids.shape
    scale = 1.0 / math.sqrt(config["head_dim"])
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (B, T))
    # Step 1, at every position t: reads (fc(aux_t), x_{t+1}) and predicts x_{t+2}.
    hidden = aux[:, :T - 1] @ p["fc.weight"].T
    q, k1, v1, residual = layer_inputs(p, config, embedding[ids[:, 1:]], hidden, positions[:, :-1])
    causal = jnp.tril(jnp.ones((T - 1, T - 1), bool))
    scores = jnp.where(causal, jnp.einsum("bqnh,bknh->bnqk", q, k1) * scale, -1e30)
    attn = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(scores, -1), v1)
    logits, r = layer_output(p, config, attn, residual)
    chains = T - 1 - DRAFT_STEPS  # starts t whose every step has a label

    def masked_nll(logits, step):
        labels, m = ids[:, step + 1:step + 1 + chains], mask[:, step - 1:step - 1 + chains]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :chains], labels)
        return (nll * m).sum() / m.sum(), ((logits[:, :chains].argmax(-1) == labels) * m).sum() / m.sum()

    loss, acc1 = masked_nll(logits, 1)
    losses = [loss]
    # Step s of chain t, at position t+s-1: reads (its step s-1 output r, x_{t+s}) and
    # predicts x_{t+s+1}; it sees step 1's keys up to t (drafted from the target's
    # states) and its own chain's keys of steps 2..s, as the engine's draft loop.
    before = jnp.tril(jnp.ones((chains, T - 1), bool))
    own_k, own_v = [], []
    for step in range(2, DRAFT_STEPS + 1):
        q, k, v, residual = layer_inputs(p, config, embedding[ids[:, step:step + chains]],
                                         r[:, :chains], positions[:, step - 1:step - 1 + chains])
        own_k.append(k)
        own_v.append(v)
        prev = jnp.where(before, jnp.einsum("bqnh,bknh->bnqk", q, k1) * scale, -1e30)
        own = jnp.stack([jnp.einsum("bqnh,bqnh->bnq", q, kj) for kj in own_k], -1) * scale
        weights = jax.nn.softmax(jnp.concatenate([prev, own], -1), -1)  # [B, N, chains, T-1+s-1]
        attn = (jnp.einsum("bnqk,bknh->bqnh", weights[..., :T - 1], v1)
                + jnp.einsum("bnqj,bqnjh->bqnh", weights[..., T - 1:], jnp.stack(own_v, 3)))
        logits, r = layer_output(p, config, attn, residual)
        losses.append(masked_nll(logits, step)[0])
    total = sum(0.7**i * loss for i, loss in enumerate(losses))
    return total, (losses[0], losses[-1], acc1)


def train(config, ids, aux, embedding, mask, steps, batch, seed=0):
    params = init_params(config, jax.random.PRNGKey(seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(100, steps // 10), steps, 3e-5)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    state = optimizer.init(params)
    embedding = jnp.asarray(embedding)

    @jax.jit
    def step(params, state, ids, aux, mask):
        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, config, embedding, ids, aux, mask)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, parts

    rng = np.random.default_rng(seed)
    start = time.time()
    for i in range(steps):
        rows = rng.integers(0, len(ids), batch)
        params, state, (l1, l2, acc) = step(params, state, ids[rows], aux[rows], mask[rows])
        if i % 100 == 0 or i == steps - 1:
            print(f"step {i:5d}  loss x+2 {float(l1):.3f}  x+{DRAFT_STEPS + 1} {float(l2):.3f}  "
                  f"top-1 x+2 {float(acc):.1%}  {time.time() - start:5.0f}s", flush=True)
    return params


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "server" / "default_model_eagle3"))
    parser.add_argument("--target", default=str(TARGET), help="the demo model drafted for")
    parser.add_argument("--examples", type=int, default=EXAMPLES,
                        help="training requests whose hidden states are kept in memory")
    parser.add_argument("--intermediate-size", type=int,
                        help="the draft MLP's width (default: the target's)")
    parser.add_argument("--data", choices=["templates", "free"], default="free",
                        help="the training set the demo was trained on")
    args = parser.parse_args()

    # The demo's own training distribution (as it was trained: --data of that run).
    examples = training_examples(args.data)
    chosen = np.random.default_rng(0).permutation(len(examples))[:args.examples]
    examples = [examples[i] for i in chosen]
    ids, aux, embedding, mask, target = target_features(examples, Path(args.target))
    width = args.intermediate_size or target["intermediate_size"]
    config = eagle3.draft_config(target, aux_layers=AUX_LAYERS, intermediate_size=width)
    config["max_position_embeddings"] = target["max_position_embeddings"]
    print(f"{len(examples)} examples, {int(mask.sum())} answer positions")
    params = train(config, ids, aux, embedding, mask, args.steps, args.batch)
    tensors = {name: np.asarray(value, np.float32) for name, value in params.items()}
    tensors["d2t"] = np.zeros(config["draft_vocab_size"], np.int64)  # same vocabulary
    out = eagle3.write_draft(args.out, config, tensors, tokenizer=args.target, overwrite=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
