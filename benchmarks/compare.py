"""Side by side on the same weights and workload, in one run:

  (a) ours: Qwen3StructuralForCausalLM through the real `vllm serve`;
  (b) tpu-inference's built-in Qwen3ForCausalLM on the same decoder (structural
      head removed), through the same `vllm serve` and host layer;
  (c) transformers' `generate` with the same batch, a plain PyTorch baseline.

(a) and (b) serve at the same time and the serving benchmark alternates
between them, `rounds` runs each per concurrency, which goes first swapping
every round: a small shared host drifts, and at high concurrency one run's
throughput hangs on how a wave of requests happens to split into prefill
steps. Medians over the runs are compared. (c) gets all `concurrency` prompts
as one batch per round. Ratios are within this run only: absolute figures
vary between machines.
"""

import contextlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np

# Big enough that model work, not the engine's per-step overhead, dominates on a
# CPU, small enough to start in seconds. head_dim 128: the built-in Qwen3 needs it.
DEFAULT_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                     vocab_size=4096)


def make_pair(directory: Path, shape: dict) -> tuple[Path, Path]:
    """(ours, builtin): one random Qwen3 decoder, with and without the structural head."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tpu_models.harness.random_checkpoints import add_structural_head, word_tokenizer

    builtin, ours = directory / "qwen3", directory / "qwen3-structural"
    tokenizer = word_tokenizer(shape["vocab_size"])
    torch.manual_seed(0)
    config = Qwen3Config(**shape, tie_word_embeddings=False, max_position_embeddings=4096,
                         eos_token_id=1, bos_token_id=1, initializer_range=0.02)
    Qwen3ForCausalLM(config).save_pretrained(builtin)
    tokenizer.save_pretrained(builtin)
    Qwen3ForCausalLM.from_pretrained(builtin).save_pretrained(ours)
    tokenizer.save_pretrained(ours)
    add_structural_head(ours)
    return ours, builtin


def serve_side_by_side(models: dict[str, Path], concurrencies, *, rounds, input_len,
                       output_len, num_prompts, vocab_size, log_dir: Path,
                       server_args=()) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Serves every model at once and alternates runs between them.

    Returns ({label: one row per concurrency, each metric the median of its
    runs}, {label: startup seconds}); servers start one after the other."""
    from tpu_models.benchmarks import serving
    from tpu_models.harness.serve_process import Server

    with contextlib.ExitStack() as stack:
        servers = {label: stack.enter_context(Server(
            model, "--served-model-name", "bench", "--max-model-len",
            str(input_len + output_len + 16), *server_args, log=log_dir / f"{label}.log"))
            for label, model in models.items()}
        runs = {label: [] for label in models}
        for concurrency in concurrencies:
            for r in range(rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for label in order:
                    runs[label] += serving.sweep(
                        servers[label].url, "bench", vocab_size=vocab_size, input_len=input_len,
                        output_len=output_len,
                        num_prompts=num_prompts or serving.default_num_prompts(concurrency),
                        concurrencies=[concurrency], avoid_tokens={0, 1}, seed=r)
        startup = {label: server.startup_seconds for label, server in servers.items()}
    return {label: [serving.median_row([row for row in rows if row["concurrency"] == c])
                    for c in concurrencies] for label, rows in runs.items()}, startup


def transformers_generate(model: Path, concurrencies, *, input_len, output_len, rounds,
                          vocab_size, dtype) -> list[dict]:
    """Output tokens/s of model.generate on a batch of `concurrency` prompts."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(torch.get_num_threads())
    net = Qwen3ForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    rng = np.random.default_rng(0)
    rows = []
    for concurrency in concurrencies:
        ids = torch.tensor(rng.integers(2, vocab_size, (concurrency, input_len)))
        kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                      pad_token_id=0, attention_mask=torch.ones_like(ids))
        with torch.no_grad():
            net.generate(ids[:, :8], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                                        "attention_mask": torch.ones_like(ids[:, :8])})
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                out = net.generate(ids, **kwargs)
                times.append(time.perf_counter() - start)
        generated = (out.shape[1] - input_len) * concurrency
        seconds = float(np.median(times))
        rows.append({"concurrency": concurrency, "output_throughput": generated / seconds,
                     "seconds": seconds})
    return rows


def compare(*, concurrencies=(1, 4, 16), input_len=128, output_len=64, num_prompts=None,
            shape=None, dtype="bfloat16", rounds=3, hf_rounds=2, out=None, plot=None) -> dict:
    from tpu_models.benchmarks import serving

    shape = {**DEFAULT_SHAPE, **(shape or {})}
    work = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    ours, builtin = make_pair(work, shape)
    served, startup = serve_side_by_side(
        {"ours": ours, "builtin": builtin}, concurrencies, rounds=rounds, input_len=input_len,
        output_len=output_len, num_prompts=num_prompts, vocab_size=shape["vocab_size"],
        log_dir=work, server_args=("--dtype", dtype))
    ours_rows, builtin_rows = served["ours"], served["builtin"]
    hf_rows = transformers_generate(builtin, concurrencies, input_len=input_len,
                                    output_len=output_len, rounds=hf_rounds,
                                    vocab_size=shape["vocab_size"], dtype=dtype)
    rows = []
    for a, b, c in zip(ours_rows, builtin_rows, hf_rows):
        rows.append({"concurrency": a["concurrency"], "ours_tok_s": a["output_throughput"],
                     "builtin_tok_s": b["output_throughput"], "transformers_tok_s": c["output_throughput"],
                     "ours_vs_builtin": a["output_throughput"] / b["output_throughput"],
                     "ours_vs_transformers": a["output_throughput"] / c["output_throughput"],
                     "ours_tpot_ms": a["median_tpot_ms"], "builtin_tpot_ms": b["median_tpot_ms"],
                     "failed": a["failed"] + b["failed"]})
    result = {"benchmark": "compare", "shape": shape, "dtype": dtype, "input_len": input_len,
              "output_len": output_len, "rounds": rounds, "startup_s": startup,
              "rows": rows, "ours": ours_rows, "builtin": builtin_rows, "transformers": hf_rows}
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"output tokens/s, {input_len} in / {output_len} out, {dtype}, same "
                        f"weights; servers: median of {rounds} alternated runs")
    for column in ("conc", "ours (vllm serve)", "built-in Qwen3 (vllm serve)", "transformers",
                   "ours / built-in", "ours / transformers"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["concurrency"]), f"{r['ours_tok_s']:.1f}", f"{r['builtin_tok_s']:.1f}",
                      f"{r['transformers_tok_s']:.1f}", f"{r['ours_vs_builtin']:.3f}",
                      f"{r['ours_vs_transformers']:.2f}")
    Console(width=140).print(table)
    if out:
        serving.write_json(Path(out), result)
    if plot:
        serving.plot({"ours": ours_rows, "built-in Qwen3": builtin_rows}, Path(plot))
    print(json.dumps({"benchmark": "compare", "rows": [
        {k: r[k] for k in ("concurrency", "ours_vs_builtin", "ours_vs_transformers")} for r in rows]}))
    return result
