"""Does the embedded demo answer in JSON? Held-out requests through a running server.

For requests the training script never saw (benchmarks/demo_data.held_out):
the share of answers that parse as one JSON object, that hold exactly the
record's fields and values, and per-field accuracy; greedy decoding, without
and with guided decoding (OpenAI `response_format` with the record's JSON
schema, vLLM's structured outputs).

    python -m benchmarks.demo_quality [--base-url URL | --model DIR] [--num 200]
"""

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.demo_data import held_out, json_schema


async def _answer(client, model, example, guided):
    kwargs = {}
    if guided:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {
            "name": example["schema"], "schema": json_schema(example["schema"])}}
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": example["request"]}],
        temperature=0.0, max_tokens=64, **kwargs)
    return reply.choices[0].message.content or ""


def score(example, text) -> dict:
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return {"valid": False, "exact": False, "fields": 0, "total": len(example["record"])}
    if not isinstance(answer, dict):
        return {"valid": False, "exact": False, "fields": 0, "total": len(example["record"])}
    right = sum(answer.get(k) == v for k, v in example["record"].items())
    return {"valid": True, "exact": answer == example["record"], "fields": right,
            "total": len(example["record"])}


def evaluate(base_url: str, model: str, examples: list[dict], guided: bool,
             concurrency: int = 16) -> dict:
    from openai import AsyncOpenAI

    async def run():
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
        limit = asyncio.Semaphore(concurrency)

        async def one(example):
            async with limit:
                return await _answer(client, model, example, guided)

        texts = await asyncio.gather(*[one(e) for e in examples])
        await client.close()
        return texts

    texts = asyncio.run(run())
    scores = [score(e, t) for e, t in zip(examples, texts)]
    return {
        "guided": guided, "requests": len(examples),
        "valid_json": sum(s["valid"] for s in scores) / len(scores),
        "exact_values": sum(s["exact"] for s in scores) / len(scores),
        "field_accuracy": sum(s["fields"] for s in scores) / sum(s["total"] for s in scores),
        "examples": [{"request": e["request"], "answer": t} for e, t in zip(examples[:3], texts)],
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--base-url", help="a running server of the demo model")
    target.add_argument("--model", help="checkpoint to start `tpu-models serve` on "
                                        "(default: the embedded demo)")
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--out", default="demo-quality.json")
    args = parser.parse_args(argv)
    examples = held_out(args.num)
    server = None
    if args.base_url:
        from openai import OpenAI
        base_url = args.base_url.rstrip("/")
        model = OpenAI(base_url=f"{base_url}/v1", api_key="unused").models.list().data[0].id
    else:
        from server.process import Server
        log = Path(tempfile.mkdtemp(prefix="demo-quality-")) / "serve.log"
        server = Server(args.model, "--served-model-name", "demo", "--dtype", "float32",
                        "--max-model-len", "256", "--kv-cache-memory-bytes", "134217728",
                        log=log).start()
        base_url, model = server.url, "demo"
    try:
        rows = [evaluate(base_url, model, examples, guided) for guided in (False, True)]
    finally:
        if server:
            server.stop()
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"demo model on {len(examples)} held-out requests")
    for column in ("decoding", "valid JSON", "exact values", "field accuracy"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row("guided (json_schema)" if row["guided"] else "free", f"{row['valid_json']:.1%}",
                      f"{row['exact_values']:.1%}", f"{row['field_accuracy']:.1%}")
    Console(width=120).print(table)
    for example in rows[0]["examples"]:
        print(f"  {example['request']!r} -> {example['answer']}")
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps({"benchmark": "demo_quality",
                      **{("guided_" if r["guided"] else "free_") + k: r[k]
                         for r in rows for k in ("valid_json", "exact_values", "field_accuracy")}}))
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
