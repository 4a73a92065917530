"""Does the embedded demo answer in JSON? Held-out requests through a running server.

For requests the training script never saw, in three sets: the generator's
held-out sentences (benchmarks/demo_sets.held_out) with "familiar" values
(names, cities, ... training used) and with "novel" made-up values training
never showed (the model must copy them); and "free", the frozen hand-written
set of freely phrased sentences (benchmarks/data/demo_free_held_out.json): the
share of answers that parse as one JSON object, that match
the record's JSON schema, that hold exactly the record's values, and per-field
accuracy; greedy decoding, without and with guided decoding (OpenAI
`response_format` with the record's JSON schema, vLLM's structured outputs).

    python -m tpu_models.benchmarks.demo_quality [--base-url URL | --model DIR] [--num 200]
"""

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from tpu_models.benchmarks.demo_sets import FREE_DEV, field_types, free_held_out, held_out, json_schema


async def answer(client, model, example, guided):
    kwargs = {}
    if guided:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {
            "name": example["schema"], "schema": json_schema(example["schema"])}}
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": example["request"]}],
        temperature=0.0, max_tokens=64, **kwargs)
    return reply.choices[0].message.content or ""


def matches_schema(answer: dict, schema: str) -> bool:
    fields = field_types(schema)
    return set(answer) == set(fields) and all(
        isinstance(answer[k], int) if kind == "integer" else isinstance(answer[k], str)
        for k, kind in fields.items())


def score(example, text) -> dict:
    total = len(example["record"])
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        return {"valid": False, "schema": False, "exact": False, "fields": 0, "total": total}
    right = sum(answer.get(k) == v for k, v in example["record"].items())
    return {"valid": True, "schema": matches_schema(answer, example["schema"]),
            "exact": answer == example["record"], "fields": right, "total": total}


def evaluate(base_url: str, model: str, examples: list[dict], guided: bool,
             concurrency: int = 16, api_key: str | None = None) -> dict:
    from openai import AsyncOpenAI

    async def run():
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "unused", timeout=300)
        limit = asyncio.Semaphore(concurrency)

        async def one(example):
            async with limit:
                return await answer(client, model, example, guided)

        texts = await asyncio.gather(*[one(e) for e in examples])
        await client.close()
        return texts

    texts = asyncio.run(run())
    scores = [score(e, t) for e, t in zip(examples, texts)]
    return {
        "guided": guided, "requests": len(examples),
        "valid_json": sum(s["valid"] for s in scores) / len(scores),
        "schema_valid": sum(s["schema"] for s in scores) / len(scores),
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
    parser.add_argument("--api-key", help="with --base-url")
    parser.add_argument("--num", type=int, default=200,
                        help="requests per generated set (the free set: all of it)")
    parser.add_argument("--sets", default="familiar,novel,free",
                        help="of familiar, novel (generated), free (the frozen hand-written "
                             "set), dev (hand-written, to choose models on)")
    parser.add_argument("--out", default="demo-quality.json")
    args = parser.parse_args(argv)
    build = {"familiar": lambda: held_out(args.num), "novel": lambda: held_out(args.num, True),
             "free": free_held_out, "dev": lambda: free_held_out(FREE_DEV)}
    chosen = args.sets.split(",")
    if unknown := set(chosen) - set(build):
        parser.error(f"--sets: unknown {sorted(unknown)}; choose from {sorted(build)}")
    sets = {name: build[name]() for name in chosen}
    server = None
    if args.base_url:
        from openai import OpenAI
        base_url = args.base_url.rstrip("/")
        model = OpenAI(base_url=f"{base_url}/v1",
                       api_key=args.api_key or "unused").models.list().data[0].id
    else:
        from tpu_models.harness.serve_process import Server
        log = Path(tempfile.mkdtemp(prefix="demo-quality-")) / "serve.log"
        server = Server(args.model, "--served-model-name", "demo", "--max-model-len", "256",
                        "--kv-cache-memory-bytes", str(256 << 20), log=log).start()
        base_url, model = server.url, "demo"
    try:
        rows = [{"set": name, **evaluate(base_url, model, examples, guided, api_key=args.api_key)}
                for name, examples in sets.items() for guided in (False, True)]
    finally:
        if server:
            server.stop()
    from rich.console import Console
    from rich.table import Table
    table = Table(title="demo model on held-out requests (" + ", ".join(
        f"{name} {len(examples)}" for name, examples in sets.items()) + ")")
    for column in ("values", "decoding", "valid JSON", "schema", "exact values", "field accuracy"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["set"], "guided (json_schema)" if row["guided"] else "unguided",
                      f"{row['valid_json']:.1%}", f"{row['schema_valid']:.1%}",
                      f"{row['exact_values']:.1%}", f"{row['field_accuracy']:.1%}")
    Console(width=120).print(table)
    for row in rows:
        if not row["guided"]:
            for example in row["examples"]:
                print(f"  {example['request']!r} -> {example['answer']}")
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps({"benchmark": "demo_quality", **{
        f"{r['set']}_{'guided' if r['guided'] else 'unguided'}_{k}": r[k] for r in rows
        for k in ("valid_json", "schema_valid", "exact_values", "field_accuracy")}}))
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
