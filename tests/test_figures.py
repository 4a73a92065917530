"""Start-up figures in the README and docs/ are the current ones from
benchmarks/results (`tpu-models bench startup`): a test fails when they disagree."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def ready_after(shape: str) -> tuple[int, int]:
    """(cold, restart) seconds to ready, rounded, from the startup benchmark's results."""
    runs = json.loads((ROOT / "benchmarks" / "results" / f"startup-{shape}.json").read_text())["runs"]
    return round(runs["cold"]["total_s"]), round(runs["warm"]["total_s"])


def flat(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def test_start_up_figures_are_the_benchmarks():
    demo, qwen, gemma = ready_after("demo"), ready_after("qwen3-0.6b"), ready_after("gemma3-1b")
    stated = (f"the demo server is ready after {demo[0]} s cold", f"and {demo[1]} s on a restart",
              f"Qwen3-0.6B / Gemma 3 1B shapes after {qwen[0]} / {gemma[0]} s cold and "
              f"{qwen[1]} / {gemma[1]} s on a restart")
    for path in ("README.md", "docs/hosts-without-a-tpu.md"):
        text = flat(path)
        for figure in stated:
            assert figure in text, f"{path}: {figure!r} (benchmarks/results/startup-*.json)"
    table = (ROOT / "benchmarks" / "README.md").read_text()
    row = re.search(r"\| \*\*ready after\*\* \|(.*)\|", table)[1]
    bold = [float(x) for x in re.findall(r"\*\*([\d.]+)\*\*", row)]
    runs = [json.loads((ROOT / "benchmarks" / "results" / f"startup-{s}.json").read_text())["runs"]
            for s in ("demo", "qwen3-0.6b", "gemma3-1b")]
    assert bold == [round(r[k]["total_s"], 1) for r in runs for k in ("cold", "warm")]


def test_eagle3_start_up_figures_are_the_benchmarks():
    cold, warm = ready_after("eagle3-demo")
    text = flat("docs/speculative-decoding.md")
    assert f"is ready after {cold} s cold and {warm} s on a restart" in text, \
        "docs/speculative-decoding.md: benchmarks/results/startup-eagle3-demo.json"
