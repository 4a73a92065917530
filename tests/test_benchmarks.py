"""Seconds-long smoke runs of every benchmark command: they run, count right, and write
their JSON (and plots). The figures themselves come from full runs (README, benchmarks/)."""

import json
from pathlib import Path

import pytest

from tpu_models.benchmarks import dispatch as bench_cli
from tpu_models.benchmarks import serving
from tpu_models.server import cli
from tpu_models.server.serve import DEFAULT_MODEL

pytestmark = pytest.mark.e2e


def test_bench_is_reached_through_its_entry_point(capsys):
    assert cli._command("bench") is bench_cli.main
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help"])
    help_text = capsys.readouterr().out
    assert exit_.value.code == 0 and (
        "{serve,compare,step,kv-cache,startup,spec,spec-calls,lora,real-scale,ab,compile,penalties,tunix,"
        "multihost,quant}" in help_text)


def test_bench_serve_against_a_running_server(demo_server, tmp_path):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    cached = "vllm:prompt_tokens_cached_total"
    before = serving.server_counters(demo_server.url)[cached]
    document = bench_cli.bench_serve(bench_cli.parser().parse_args([
        "serve", "--base-url", demo_server.url, "--api-key", demo_server.api_key,
        "--tokenizer", str(DEFAULT_MODEL), "--input-len", "24", "--output-len", "8",
        "--num-prompts", "6", "--concurrency", "1,3", "--warmup", "1",
        "--out", str(out), "--plot", str(plot)]))
    rows = document["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for row in rows:
        assert row["failed"] == 0 and row["completed"] == 6
        assert row["total_output_tokens"] == 6 * 8 and row["total_input_tokens"] == 6 * 24
        assert row["median_ttft_ms"] > 0 and row["median_tpot_ms"] > 0
    assert json.loads(out.read_text())["rows"][0]["concurrency"] == 1
    assert plot.stat().st_size > 0
    # Every prompt was new to the server: none had its prefill served from the prefix cache.
    assert serving.server_counters(demo_server.url)[cached] == before


def test_bench_compare_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIP_JAX_PRECOMPILE", "1")  # two servers: start them fast
    from tpu_models.benchmarks.compare import compare
    result = compare(concurrencies=[2], input_len=16, output_len=8, num_prompts=4, rounds=2,
                     shape={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                            "vocab_size": 512},
                     dtype="float32", hf_rounds=1, out=tmp_path / "compare.json")
    for row in result["rows"]:
        assert row["failed"] == 0
        assert row["ours_tok_s"] > 0 and row["builtin_tok_s"] > 0 and row["transformers_tok_s"] > 0
    for label in ("ours", "builtin"):  # medians of two runs, each of 4 completed requests
        assert [len(r["runs_output_throughput"]) for r in result[label]] == [2]
        assert [r["completed"] for r in result[label]] == [8]
    assert json.loads((tmp_path / "compare.json").read_text())["benchmark"] == "compare"


def test_bench_ab_smoke(qwen3, tmp_path):
    """This tree against its own HEAD, which bench ab lays out from `git archive` as the
    wheel installs it (one import root) and serves beside this tree."""
    from tpu_models.benchmarks import ab
    result = ab.main(["--base", "HEAD", "--model", str(qwen3), "--concurrency", "2",
                      "--rounds", "1", "--num-prompts", "2", "--input-len", "16",
                      "--output-len", "4", "--out", str(tmp_path / "ab.json")])
    (row, ) = result["rows"]
    assert row["failed"] == 0 and row["this_tok_s"] > 0 and row["base_tok_s"] > 0, result["logs"]
    assert len(row["round_ratios"]) == 1
    base = Path(result["base_tree"])
    assert (base / "tpu_models" / "loaders" / "hf.py").exists() and not (base / "loaders").exists()
    assert json.loads((tmp_path / "ab.json").read_text())["benchmark"] == "ab"


def test_bench_step_smoke(tmp_path):
    out = tmp_path / "step.json"
    cli.main(["bench", "step", "--layers", "1", "--vocab-size", "1024", "--batch", "1,2",
              "--context", "32", "--repeats", "1", "--bandwidth-mib", "128", "--lora", "2x8",
              "--out", str(out)])
    result = json.loads(out.read_text())
    assert {(r["batch"], r["context"]) for r in result["rows"]} == {(1, 32), (1, 1), (2, 32), (2, 1)}
    for row in result["rows"]:
        assert row["step_ms"] > 0 and 0 < row["efficiency"] and row["limit_ms"] > 0
        assert row["lora_step_ms"] > 0  # the same step with 2 adapters in slots
        assert row["read_gb_s_before"] > 0 and row["read_gb_s_after"] > 0
    assert len(result["bandwidth_samples"]) == 2 * len(result["rows"])  # before and after each


def test_bench_spec_reports_the_median_run_and_the_draft_length():
    from tpu_models.benchmarks import spec_decode
    runs = [[{"set": "free", "method": "off", "speedup": 1.0, "output_throughput": 100.0,
              "same_text_as_off": 139},
             {"set": "free", "method": "eagle3", "speedup": ratio, "output_throughput": 100 * ratio,
              "same_text_as_off": same}] for ratio, same in ((1.3, 139), (1.1, 138), (1.2, 139))]
    off, eagle3 = spec_decode.median_runs(runs)
    assert off["speedup"] == 1.0
    assert eagle3["speedup"] == 1.2 and eagle3["output_throughput"] == 120.0  # the median run
    assert eagle3["runs_speedup"] == [1.3, 1.1, 1.2]
    assert eagle3["same_text_as_off"] == 138  # the worst run
    flag, config = spec_decode._speculation("eagle3", None, 4)
    assert flag == "--speculative-config"
    assert json.loads(config)["num_speculative_tokens"] == 4
    assert json.loads(config)["model"].endswith("default_model_eagle3")  # the shipped draft
    assert spec_decode._speculation("eagle3", None, None) == ["--speculative", "eagle3"]


def test_export_speed_writes_the_size_asked():
    # Below 400 MB the checkpoint narrows: a 30 MB request once wrote 302 MB.
    from tpu_models.benchmarks.export_speed import config_for
    for size_mb in (30, 100, 300, 600):
        c = config_for(size_mb)
        hidden, mlp, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        per_layer = hidden * (16 * 64 * 2 + 8 * 64 * 2) + 3 * hidden * mlp
        params = 2 * c["vocab_size"] * hidden + hidden * hidden + layers * per_layer
        assert abs(params * 4 / 2**20 - size_mb) < 0.1 * size_mb, (size_mb, c)
