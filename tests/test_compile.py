"""`tpu-models compile`: our models built for TPU slices and compiled by libtpu, the TPU's
own compiler, on this CPU host; nothing allocated or run.

Sizes are checked against arithmetic on the checkpoints' configs (tpu-inference's
documented cache layout: KV heads padded to the tensor-parallel size, head_dim to
128, K and V interleaved), and the program set against what a CPU server of the
same configuration precompiles.
"""

import ast
import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tpu_models.harness import preloaded
from tpu_models.server.serve import DEFAULT_MODEL
from tests.conftest import tpu_compile_env

pytestmark = pytest.mark.e2e  # each compile is a vLLM start-up: 20-60 s
DOCTOR = Path(__file__).parents[1] / "server" / "doctor_models"
SMALL = ("--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32")


def compile_(tmp_path, *args, env=None) -> tuple[int, dict | None, str]:
    """`tpu-models compile ARGS --json`: (exit status, report, output), forked from the
    interpreter that imported vLLM (harness/preloaded.py) as a server is."""
    run = len(list(tmp_path.glob("report-*.log")))
    out, log = tmp_path / f"report-{run}.json", tmp_path / f"report-{run}.log"
    # compile sets the platform and the slice; in-process CPU tests leave
    # MIN_TOKEN_BUCKET=1 behind.
    environment = tpu_compile_env({k: v for k, v in os.environ.items() if k not in
                                   ("TPU_ACCELERATOR_TYPE", "MIN_TOKEN_BUCKET")})
    done = preloaded.python_module("tpu_models.server.cli", ["compile", *args, "--json", str(out)],
                                   env={**environment, **(env or {})}, log=log)
    status = done.wait(timeout=600)
    report = json.loads(out.read_text()) if out.exists() else None
    return status, report, log.read_text()


def config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def programs(report: dict, name: str) -> list[dict]:
    return [p for p in report["programs"] if p["name"] == name]


def kv_bytes_per_token(cfg: dict, layers: int, tp: int, dtype_bytes: int) -> float:
    """One chip's KV bytes per token in tpu-inference's layout: heads padded to the
    TP size and split over it, K and V packed into 32-bit words, head_dim to 128."""
    heads = max(cfg["num_key_value_heads"], tp) // tp
    packing = 4 // dtype_bytes
    head_dim = -(-cfg["head_dim"] // 128) * 128
    return layers * -(-2 * heads // packing) * packing * head_dim * dtype_bytes


def test_every_topology_is_the_slice_libtpu_builds():
    script = ("import json\n"
              "from jax.experimental import topologies\n"
              "from tpu_models.topology.slices import TOPOLOGIES\n"
              "out = {}\n"
              "for t in TOPOLOGIES.values():\n"
              "    d = topologies.get_topology_desc(platform='tpu', topology_name=t.libtpu_name,\n"
              "                                     chips_per_host_bounds=t.host_chips).devices\n"
              "    out[t.name] = [len(d), len({x.process_index for x in d}), d[0].device_kind]\n"
              "print(json.dumps(out))\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1",
           "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    from tpu_models.topology.slices import TOPOLOGIES, topology
    found = json.loads(done.stdout.strip().splitlines()[-1])
    kinds = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v5p": "TPU v5"}
    for name, t in TOPOLOGIES.items():
        assert found[name] == [t.chips, t.hosts, kinds[name.split("-")[0]]], name
    assert topology("v6e-16").hosts == 4 and topology("v5p-8").chips == 4
    assert topology("v5litepod-8") == topology("v5e-8")
    for name in ("v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8", "v5p-8", "v6e-16"):
        assert name in TOPOLOGIES


def test_pallas_lowering_keys_of_different_dmas_hash_apart():
    # Two DMAs of a kernel differ in their pytree's node data (the slices they move):
    # upstream's keys hash alike, every lookup then compares keys in full.
    import dataclasses

    from jax._src import indexing
    from jax._src.pallas.mosaic import lowering
    from jax.tree_util import tree_structure

    from tpu_models import adapt
    adapt.apply()

    def key(cls, stop):
        return cls(primitive="dma_start", kernel_type=None, avals_in=(), avals_out=(),
                   params=(("tree", tree_structure((indexing.Slice(0, stop, 1), ))), ),
                   block_shapes=(), grid_arity=0)

    upstream = lowering.PallasLoweringCacheKey.__mro__[1]
    assert dataclasses.is_dataclass(upstream) and upstream is not lowering.PallasLoweringCacheKey
    assert hash(key(upstream, 1)) == hash(key(upstream, 2))  # what the patch is for
    ours = lowering.PallasLoweringCacheKey
    assert hash(key(ours, 1)) != hash(key(ours, 2)) and key(ours, 1) != key(ours, 2)
    assert hash(key(ours, 1)) == hash(key(ours, 1)) and key(ours, 1) == key(ours, 1)
    replaced = dataclasses.replace(key(ours, 1), grid_arity=1)  # as the lowering does
    assert type(replaced) is ours and hash(replaced) != hash(key(ours, 1))


def test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8(tmp_path):
    status, report, output = compile_(tmp_path, "--topology", "v6e-8", "--tensor-parallel-size",
                                      "8", "--speculative", "eagle3", "--kv-cache-dtype", "fp8",
                                      *SMALL)
    assert status == 0, output[-3000:]
    assert report["fits"] and report["chips"] == 8 and report["hosts"] == 1
    assert report["device_kind"] == "TPU v6 lite" and report["dtype"] == "bfloat16"
    # One backbone program per token bucket (16, 32), each with two all-reduces a layer
    # (attention and MLP outputs) and one for the embedding lookup.
    target = config(DEFAULT_MODEL)
    backbones = programs(report, "backbone")
    assert sorted(p["tokens"] for p in backbones) == [16, 32]
    assert {p["all_reduces"] for p in backbones} == {2 * target["num_hidden_layers"] + 1}
    # The drafter's own jits, compiled by the warm-up call that compiles them on a TPU.
    names = {p["name"] for p in report["programs"]}
    assert {"drafter_propose > _propose", "drafter_prepare_inputs > _prepare_inputs"} <= names
    assert any(n.endswith("_rejection_sampler > forward") for n in names)
    # The cache: the target's layers and the draft's one, 2 KV heads over 8 chips, in
    # fp8 (e4m3 on the flax path), though one head a chip packs into bf16's bytes.
    chip = report["per_chip"]
    assert report["kv_cache_element_type"] == "float8_e4m3fn"
    per_token = kv_bytes_per_token(target, target["num_hidden_layers"] + 1, 8, 1)
    assert per_token == kv_bytes_per_token(target, target["num_hidden_layers"] + 1, 8, 2)
    assert chip["kv_cache_bytes"] == report["kv_cache_blocks"] * report["block_size"] * per_token
    # Weights: bf16, the target's and the draft's, each chip holding at least its share.
    from safetensors import safe_open
    params = 0
    for file in (DEFAULT_MODEL / "model.safetensors",
                 DEFAULT_MODEL.parent / "default_model_eagle3" / "model.safetensors"):
        with safe_open(file, "np") as f:
            params += sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys() if n != "d2t")
    assert params * 2 / 8 < chip["weights_bytes"] < params * 2
    assert {d for d in chip["weights_by_dtype"] if "float" in d} == {"bfloat16"}
    assert chip["weights_bytes"] + chip["kv_cache_bytes"] <= 0.93 * chip["hbm_bytes"]
    roof = report["decode_roofline"]
    assert roof["bandwidth_bytes_per_second"] == 1.64e12  # v6e's HBM, JAX's TPU table
    assert roof["weights_only_seconds"] == pytest.approx(chip["weights_bytes"] / 1.64e12)
    assert "estimates, not measurements" in output
    # The attention kernel's reads at one request of 256 tokens: its pages of the chip's
    # 5 caches, the backbone's kernels reading the target's 4, the drafter's its 1.
    one = roof["kv_read_bytes_one_request"]
    assert one == -(-256 // report["block_size"]) * report["block_size"] * per_token
    assert [p["kv_read_bytes"] for p in backbones] == pytest.approx([one * 4 / 5] * 2)
    drafts = programs(report, "drafter_propose > _propose")
    assert drafts and [p["kv_read_bytes"] for p in drafts] == pytest.approx([one / 5] * len(drafts))


def test_explain_accounts_for_the_decode_steps_bytes(tmp_path):
    # The demo at TP 8 on a v6e-8, its decode backbone (16 tokens) explained from its HLO.
    status, report, output = compile_(tmp_path, "--topology", "v6e-8", "--tensor-parallel-size",
                                      "8", "--explain", "backbone tokens 16", *SMALL)
    assert status == 0, output[-3000:]
    decode, = [p for p in report["programs"] if "explain" in p]
    assert (decode["name"], decode["tokens"]) == ("backbone", 16)
    # A sampler's log-probs and plain variants differ only in tpu-inference's
    # `_cache_collision_dummy` (the program adds 0 * its sum): compiled once a pair.
    samplers = programs(report, "sample")
    plain = [p for p in samplers if not p["signature"]["logprobs"]]
    assert len(plain) == len(samplers) // 2 and all(
        "'logprobs': True" in p["same_program_as"] and re.search(
            rf"'num_reqs': {p['requests']}[,}}]", p["same_program_as"]) for p in plain), [
        p.get("same_program_as") for p in plain]
    assert not any("same_program_as" in p for p in samplers if p["signature"]["logprobs"])
    explain, total = decode["explain"], decode["bytes_accessed"]
    groups = explain["groups"]
    assert list(groups) == ["weights", "KV cache", "activations", "collectives", "copies and pads"]
    # The groups and what they leave over are the compiler's count; this count follows
    # the compiler's own closely enough for the backbone to leave little over.
    assert sum(g["bytes"] for g in groups.values()) + explain["other_bytes"] == pytest.approx(total)
    assert abs(explain["other_bytes"]) < 0.05 * total, explain["other_bytes"]
    other = explain["other_bytes"] / total
    assert sum(g["share"] for g in groups.values()) == pytest.approx(1 - other)
    # Each weight the backbone uses read once: a chip's share of each layer (q, o and the
    # MLP split over 8 chips, k and v whole: 2 KV heads), the final norm and the 16
    # embedding rows gathered, not the table. The head_dim-long q/k norms are padded to
    # a tile of 256 lanes.
    cfg = config(DEFAULT_MODEL)
    D, N, K, H, F = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                      "head_dim", "intermediate_size"))
    layers = cfg["num_hidden_layers"]
    per_layer = 2 * (D * N * H // 8 + 2 * D * K * H + N * H * D // 8 + 3 * D * F // 8
                     + 2 * D + 2 * H)
    read = layers * per_layer + 2 * D + 16 * D * 2
    padding = layers * 2 * (256 - H) * 2
    assert read <= groups["weights"]["bytes"] <= read + padding, groups["weights"]["bytes"]
    assert groups["weights"]["bytes"] < report["per_chip"]["weights_bytes"]
    # Two all-reduces a layer and the embedding's; the cache is only the kernel's.
    assert groups["collectives"]["ops"] == {"all-reduce": 2 * layers + 1}
    assert groups["KV cache"]["bytes"] == 0 and explain["kernel_calls"] >= layers
    # What the kernel reads, from its arithmetic: one request at --max-model-len 256
    # reads its 256 / block_size pages of every layer, 1 KV head a chip.
    pages = -(-256 // report["block_size"])
    kv_read = layers * pages * report["block_size"] * kv_bytes_per_token(cfg, 1, 8, 2)
    reads = explain["kv_reads"]
    assert decode["kv_read_bytes"] == reads["one_request_at_max_model_len_bytes"] == kv_read
    assert reads["full_cache_bytes"] == pytest.approx(report["per_chip"]["kv_cache_bytes"])
    assert {p["kv_read_bytes"] for p in programs(report, "backbone")} == {kv_read}
    assert all(p["kv_read_bytes"] == 0 for p in report["programs"] if p["name"] != "backbone")
    copies = groups["copies and pads"]
    assert 0 <= copies["in_vmem_bytes"] <= copies["bytes"]
    for line in ("Where backbone (tokens 16, requests 8)'s bytes go", "not a measurement",
                 *(f"largest, {g}: " for g in ("weights", "activations", "collectives")),
                 "the attention kernel's KV-cache reads", "are arrays in VMEM (memory space 1)"):
        assert line in output, line
    # A prefetch's result: its destination in VMEM (S(1)), its source, its sync flag
    # (S(2), counted as 4 KiB): half of the 2 x 5.24 MB and the flag's 4 KiB in VMEM.
    from tpu_models.server.tools.compile_explain import vmem_share
    prefetch = ("(bf16[2560,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[2560,1024]{1,0:T(8,128)(2,1)}, "
                "u32[]{:S(2)})")
    assert vmem_share(prefetch) == pytest.approx(2560 * 1024 * 2 / (2 * 2560 * 1024 * 2 + 4096))
    assert vmem_share("bf16[2560,1024]{1,0:T(8,128)(2,1)}") == 0
    # A name no program has is refused, naming those there are.
    from tpu_models.server.tools.compile_explain import ProgramNotFound, select
    with pytest.raises(ProgramNotFound, match=r"no such program; the programs: .*backbone"):
        select(report["programs"], "bakcbone")
    with pytest.raises(ProgramNotFound, match=r"backbone has no such variant; .*tokens 16"):
        select(report["programs"], "backbone tokens 48")
    assert len(select(report["programs"], "backbone (tokens 32, requests 8)")) == 1


def test_gemma3_hybrid_cache_in_fp8_with_lora_slots_on_v5e_1(tmp_path):
    model = DOCTOR / "gemma3"
    args = ("--topology", "v5e-1", "--kv-cache-dtype", "fp8", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", *SMALL)
    status, report, output = compile_(tmp_path, str(model), *args)
    assert status == 0, output[-3000:]
    cfg, chip = config(model), report["per_chip"]
    assert report["kv_cache_element_type"] == "float8_e4m3fn"
    assert report["device_kind"] == "TPU v5 lite"
    assert chip["hbm_bytes"] == 16 * 2**30
    # Hybrid groups: the 5 sliding layers and the global one, a layer per group, share
    # one pool of pages (a page holds one layer's block of tokens), so the cache is as
    # large as one layer's at the pool's size. One KV head a chip: fp8's 4-way packing
    # takes as many bytes as bf16's 2-way (tpu-inference's layout).
    assert kv_bytes_per_token(cfg, 1, 1, 1) == kv_bytes_per_token(cfg, 1, 1, 2)
    per_token = kv_bytes_per_token(cfg, 1, 1, 1)
    assert chip["kv_cache_bytes"] == report["kv_cache_blocks"] * report["block_size"] * per_token
    # LoRA slots: A [in, slots, rank] and B [slots, rank, out] for each projection.
    D, H = cfg["hidden_size"], cfg["head_dim"]
    q, kv, mlp = cfg["num_attention_heads"] * H, cfg["num_key_value_heads"] * H, cfg["intermediate_size"]
    per_layer = (D + q) + 2 * (D + kv) + (q + D) + 2 * (D + mlp) + (mlp + D)
    assert chip["other_bytes"] >= cfg["num_hidden_layers"] * per_layer * 2 * 8 * 2
    assert programs(report, "backbone")


def test_int8_qwen3_at_tensor_parallel_4_in_the_kv_budget_asked(tmp_path):
    model = DOCTOR / "qwen3-structural"
    budget = 1 << 30
    status, report, output = compile_(tmp_path, str(model), "--topology", "v6e-4",
                                      "--tensor-parallel-size", "4", "--quant",
                                      "int8-weight-only", "--kv-cache-memory-bytes", str(budget),
                                      *SMALL)
    assert status == 0, output[-3000:]
    chip = report["per_chip"]
    # --kv-cache-memory-bytes is the cache's size over the slice (the worker's budget),
    # to the block; a TPU's worker ignored it before (adapt.kv_cache).
    cfg = config(model)
    block = report["block_size"] * kv_bytes_per_token(cfg, cfg["num_hidden_layers"], 4, 2)
    assert budget - 4 * block < 4 * chip["kv_cache_bytes"] <= budget
    # Qwix quantized the projections while loading: its program compiled for the slice.
    assert "load > Qwix quantization > qwix_quantize_nnx_model" in {
        p["name"] for p in report["programs"]}
    # One byte a projection weight, a chip holding its share: q/o split by head, k/v
    # whole (2 KV heads for 4 chips), the MLP split along its width.
    D, N, K, H = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "head_dim"))
    per_layer = D * N * H // 4 + 2 * D * K * H + N * H * D // 4 + 3 * D * cfg["intermediate_size"] // 4
    assert chip["weights_by_dtype"]["int8"] == cfg["num_hidden_layers"] * per_layer


def test_too_large_a_cache_is_refused_naming_the_program_and_what_would_fit(tmp_path):
    status, report, output = compile_(tmp_path, "--topology", "v5e-1", "--kv-cache-memory-bytes",
                                      str(40 * 10**9), *SMALL)
    assert status == 1
    verdict = output.strip().splitlines()[-1]
    assert verdict.startswith("compile: ") and "did not compile for v5e-1" in verdict
    assert re.search(r"backbone \(tokens \d+, requests 8\) \(HBM\): .*exceeds available HBM",
                     verdict)
    assert "--kv-cache-memory-bytes" in output.split("What would fit")[1]
    assert any(p.get("error_kind") == "HBM" for p in report["programs"])

    status, _, output = compile_(tmp_path, "--topology", "v9z-3")
    assert status == 2
    assert output.strip().splitlines()[-1].startswith("compile: cannot run: unknown TPU topology")


def shape(tmp_path, name: str, **overrides) -> Path:
    """A config-only checkpoint of one of the real shapes (no weights: none are read)."""
    from tpu_models.harness.random_checkpoints import shape_config, word_tokenizer
    directory = tmp_path / name
    directory.mkdir()
    cfg = shape_config(name, **overrides)
    (directory / "config.json").write_text(json.dumps(cfg))
    word_tokenizer(cfg["vocab_size"]).save_pretrained(directory)
    return directory


def test_gemma3_prompt_logprobs_temporaries_stay_within_their_share(tmp_path):
    # Gemma 3 1B on two of its layers, with Gemma 3 4B's 262,208 ids (no multiple of the
    # TPU's 128 lanes: a reshape of the logits into pieces copied them all); prompt
    # log-probs are precompiled for steps of up to 1,024 tokens. Whole, their
    # log-softmax, top-k and ranks took 2 x 1,024 x 262,208 x 4 bytes (2 GiB); a piece
    # of 32 rows at a time, a few pieces'.
    from tpu_models import memory
    from tpu_models.logprobs import PIECE_BYTES
    vocab, seqs = 262_208, 8
    model = shape(tmp_path, "gemma3-1b", num_layers=2, vocab_size=vocab)
    status, report, output = compile_(tmp_path, str(model), "--topology", "v5e-1",
                                      "--max-model-len", "1024", "--max-num-seqs", str(seqs),
                                      "--max-num-batched-tokens", "1024")
    assert status == 0, output[-3000:]
    prompt = programs(report, "compute_and_gather_prompt_logprobs")
    assert max(p["tokens"] for p in prompt) == 1024
    assert all(p["temp_bytes"] <= 4 * PIECE_BYTES + (8 << 20) for p in prompt), [
        (p["tokens"], p["temp_bytes"]) for p in prompt]
    # The step's float32 logits are its input: 1,024 rows of them.
    largest = max(prompt, key=lambda p: p["tokens"])
    assert largest["transient_bytes"] >= 1024 * vocab * 4
    # One chip's accounting adds up to its HBM, the penalties' counts in it (allocated
    # at start-up: a row of int32 counts and 32 recent ids a sequence).
    chip = report["per_chip"]
    assert chip["buffers"]["penalty counts"] == 4 * seqs * (vocab + 32)
    assert (chip["weights_bytes"] + chip["kv_cache_bytes"] + sum(chip["buffers"].values())
            + chip["largest_program_transient_bytes"] + chip["free_bytes"]) == chip["hbm_bytes"]
    assert sum(chip["weights_by_dtype"].values()) == chip["weights_bytes"]
    # The engine sized its cache by its own bound on the largest step, which holds
    # against the compiler's count, and leaves that bound its room.
    assert chip["largest_step_estimate_bytes"] >= chip["largest_program_transient_bytes"]
    step = memory.Step(chip["largest_step_estimate_bytes"], "")
    room = memory.room_beyond_utilization(step, chip["hbm_bytes"], 0.92)
    assert chip["kv_cache_bytes"] <= (int(chip["hbm_bytes"] * 0.92) - chip["weights_bytes"]
                                      - chip["other_bytes"] - room)
    assert report["fits"] and chip["free_bytes"] >= 0


@pytest.mark.parametrize("name, length, options", [
    ("qwen3-8b", "4096", ("--topology v5e-4 --tensor-parallel-size 4", "--quant int8-weight-only")),
    ("qwen3-32b", "32768", ("--topology v5e-8 --tensor-parallel-size 8",))])
def test_a_model_too_large_for_a_chip_is_told_what_would_fit(tmp_path, name, length, options):
    # Refused by the engine's own sizing before any program compiles: the verdict names
    # HBM and the sizes, and the options are checked by the same arithmetic.
    status, _, output = compile_(tmp_path, str(shape(tmp_path, name)), "--topology", "v5e-1",
                                 "--max-model-len", length)
    assert status == 1, output[-3000:]
    verdict = output.strip().splitlines()[-1]
    assert re.match(r"compile: does not fit v5e-1's HBM: 16.00 GiB a chip, 14.72 GiB at "
                    r"--gpu-memory-utilization 0.92; weights [\d.]+ GiB and buffers [\d.]+ GiB "
                    rf"a chip leave 0.00 GiB for the KV cache, and one request at --max-model-len "
                    rf"{int(length):,} needs [\d.]+ GiB \(the weights and buffers alone exceed it\)$",
                    verdict), verdict
    advice = output.split("What would fit")[1].rsplit("\ncompile: ", 1)[0]
    for option in options:
        assert option in advice, advice
    assert "--gpu-memory-utilization" not in advice and "increas" not in verdict


def _precompiled(log: str) -> Counter:
    """(program, signature) of each `Precompile NAME --> {...}` line a server logged."""
    found = re.findall(r"Precompile (.+?) --> (\{.*?\})(?: \(background\))?$", log, re.MULTILINE)
    return Counter((name.removeprefix("worker0 "), signature) for name, signature in found)


def test_the_program_set_is_what_a_cpu_server_precompiles(demo_server, tmp_path):
    # The shared demo server (tpu-models serve, precompiling as users get it): its CPU
    # defaults and options, here given to the compile for a TPU.
    import time
    deadline = time.monotonic() + 300
    while "all token buckets compiled" not in demo_server.output():
        assert time.monotonic() < deadline, "the demo server's buckets did not finish compiling"
        time.sleep(2)
    served = _precompiled(demo_server.output())
    status, report, output = compile_(
        tmp_path, "--topology", "v6e-1", "--dtype", "float32", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(256 << 20), "--max-num-batched-tokens", "256",
        "--max-num-seqs", "64", env={"MIN_TOKEN_BUCKET": "1"})
    assert status == 0, output[-3000:]
    def key(name: str, signature: dict) -> tuple[str, str]:
        return re.sub(r"^worker\d+ ", "", name), json.dumps(signature, sort_keys=True)

    compiled, warmed = Counter(), set()
    for p in report["programs"]:
        signature = p["signature"] | {k: v for k, v in (("num_tokens", p["tokens"]),
                                                         ("num_reqs", p["requests"])) if v}
        if p.get("warm_up"):  # its jits, compiled by one warm-up call
            warmed.add(key(p["warm_up"], signature))
        else:
            compiled[key(p["name"], signature)] += 1
    compiled.update(warmed)
    assert sum(served.values()) > 50
    assert compiled == Counter({key(name, ast.literal_eval(signature)): n
                                for (name, signature), n in served.items()})


def test_an_asynchronous_slice_counts_as_the_compiler_counts_it():
    """slice-start (the 8B's weights into VMEM a third at a time) is its slice read and
    written, slice-done its result, and a reader's read of the slices, joined in place
    by a ConcatBitcast, a copy's in VMEM: counted so, the 8B decode step's groups add up
    to libtpu's 4,084.83 MB within 2 MB, and its down projections read no HBM twice."""
    from tpu_models.server.tools.compile_explain import (
        ACTIVATIONS, COPIES, WEIGHTS_GROUP, Count)
    tile, third = "{0:T(1024)(128)(4,1)", 4_194_304
    whole = f"s8[{3 * third}]{tile}S(1)}}"
    slices = "\n".join(
        f"  %slice-start.{i} = ((s8[{3 * third}]{tile}}}), s8[{third}]{tile}S(1)}}, "
        f"s32[]{{:S(2)}}) slice-start(%w), slice={{[{i * third}:{(i + 1) * third}]}}\n"
        f"  %slice-done.{i} = s8[{third}]{tile}S(1)}} slice-done(%slice-start.{i})"
        for i in range(3))
    hlo = f"""HloModule m

%fused (p0: s8[{3 * third}]) -> s8[16] {{
  %p0 = {whole} parameter(0)
  ROOT %neg = s8[16]{{0}} reduce(%p0)
}}

ENTRY %main (w: s8[{3 * third}]) -> s8[16] {{
  %w = s8[{3 * third}]{tile}}} parameter(0)
{slices}
  %custom-call = {whole} custom-call(%slice-done.0, %slice-done.1, %slice-done.2), custom_call_target="ConcatBitcast"
  %bitcast = {whole} bitcast(%custom-call)
  ROOT %fusion = s8[16]{{0}} fusion(%bitcast), kind=kLoop, calls=%fused
}}
"""
    count = Count(hlo, {f"s8[{3 * third}]": WEIGHTS_GROUP})
    assert count.bytes == {WEIGHTS_GROUP: 3 * third, COPIES: 9 * third, ACTIVATIONS: 16}
    assert count.vmem_copies == 9 * third  # the slices written, completed and read, in VMEM
