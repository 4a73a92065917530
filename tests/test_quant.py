"""Quantization's quality: Qwix presets, the fp8 KV cache, pre-quantized checkpoints.

Every preset is served by the real `vllm serve --quant PRESET` (Qwen3-structural:
the trained demo; Gemma 3: a tiny model with decisive logits), and its
next-token distributions, read back as full-vocabulary prompt logprobs, are
compared with unquantized transformers. The rest is model level, through
tpu-inference's get_model (the path `vllm serve` takes, Qwix included). What is
checked before a model is built (presets, rule files, schemes): test_quant_rules.py.

Bounds. A quantizer adds a relative error eps to each matmul it touches:
- b-bit integers, one absmax scale per n values: the rounding step is
  max|w| / (2^(b-1) - 1), its error uniform, so eps = (max|w| / rms(w)) /
  (2^(b-1) - 1) / sqrt(12); max/rms ~ 3 over a channel of a few hundred
  weights, ~ 2.5 over a tile of 32. int8: 0.68%, int4 (tiles of 32): 10.3%;
- float8_e4m3fn: 3 mantissa bits, relative error uniform in +-2^-4: 3.6%;
- weights and activations both rounded: sqrt(2) x; errors that add up
  (fp8 matmuls and the fp8 KV cache) add in quadrature.
A top-1 token flips only where the logit margin is smaller than the logit
error, and margins have a density near zero, so disagreement grows like eps;
KL grows like eps^2 (second order in the logit error). Anchored at
int8-weight-only (top-1 >= 99%, mean KL <= 5e-4, max KL <= 0.05: 2-8x what it
measures on the demo), with r = eps / eps(int8-weight-only):
    top-1 >= 1 - 1% r,  mean KL <= 5e-4 r^2,  max KL <= min(0.05 r^2, 2 nats),
    greedy prefix agreement >= (1 - 1% r) ^ tokens (a whole sequence survives).
Served, the reference's log-probabilities refine them: the KL bounds scale with
its logit variance over the vocabulary against the anchor's (a logit std of
1.6; the demo's is 2.2), and top-1 may also flip at every position whose
margin is below 4 sqrt(mean KL bound) (two errors of the top two's difference:
the demo's requests hold made-up words, where its margins crowd near zero).
A broken quantizer (wrong scale or layout) gives KL of nats and top-1 near
chance; no quantization at all gives KL ~ 0, which is checked against too.
"""

import asyncio
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tpu_models.quant import checkpoint as prequantized
from tpu_models.server.serve import DEFAULT_MODEL
from tests.test_quant_rules import FP8_DYNAMIC
from tests.tiny import Reference, make_gemma3

DEMO = DEFAULT_MODEL  # the trained Qwen3-structural demo (decisive, JSON answers)
GREEDY_TOKENS = 16

_INT8 = 3 / 127 / math.sqrt(12)
_FP8 = 2**-4 / math.sqrt(3)
EPS = {
    "int8-weight-only": _INT8,
    "int8": math.sqrt(2) * _INT8,
    "fp8": math.sqrt(2) * _FP8,
    "int4-weight-only": 2.5 / 7 / math.sqrt(12),
    "kv:fp8": _FP8,
}


def bounds(eps: float, reference: np.ndarray | None = None) -> dict:
    """The bounds at relative error eps. Given the reference's log-probabilities
    [positions, V]: the KL bounds grow with its logit spread, and top-1 may also
    flip wherever its margin is within reach of the error."""
    r = eps / _INT8
    kl_scale, flips = 1.0, 0.01 * r
    if reference is not None:
        # A relative error moves each logit in proportion to its spread, and KL ~
        # var(logit error) / 2: the anchor's spread was a logit std of 1.6.
        kl_scale = max(1.0, float(np.mean(np.var(reference, -1))) / 1.6**2)
    mean_kl = 5e-4 * r * r * kl_scale
    if reference is not None:
        # The top two's difference errs by about 2 sqrt(KL); a margin below two
        # such errors can flip.
        top2 = np.sort(reference, -1)[:, -2:]
        flips = max(flips, float(np.mean(top2[:, 1] - top2[:, 0] < 4 * math.sqrt(mean_kl))))
    return {"top1": 1 - flips, "mean_kl": mean_kl, "max_kl": min(0.05 * r * r * kl_scale, 2.0),
            "greedy_prefix": (1 - 0.01 * r)**GREEDY_TOKENS}


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def distances(reference: np.ndarray, other: np.ndarray) -> dict:
    """Top-1 agreement and KL(reference || other); both [positions, V] log-probabilities."""
    kl = (np.exp(reference) * (reference - other)).sum(-1)
    return {"top1": float((reference.argmax(-1) == other.argmax(-1)).mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def assert_within(measured: dict, bound: dict, what: str) -> None:
    print(f"{what}: {json.dumps({k: round(v, 6) for k, v in measured.items()})}")
    # fp32 noise (logits within ~1e-5) gives KL ~ 1e-10; the bounds below: module docstring
    assert measured["mean_kl"] > 1e-8, f"{what}: identical to unquantized: nothing quantized?"
    assert measured["top1"] >= bound["top1"], (what, measured, bound)
    assert measured["mean_kl"] <= bound["mean_kl"], (what, measured, bound)
    assert measured["max_kl"] <= bound["max_kl"], (what, measured, bound)


# --- model level (tpu-inference's get_model, Qwix through its qwix_utils) --------


def write_fp8_checkpoint(source: Path, out: Path, config: dict = FP8_DYNAMIC) -> Path:
    """`source` with every *_proj weight stored as compressed-tensors FP8 (per-channel
    absmax scales), as llm-compressor's FP8_DYNAMIC recipe writes it."""
    out.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    tensors = {}
    for name, weight in load_file(source / "model.safetensors").items():
        if re.fullmatch(r".*_proj\.weight", name):
            scale = weight.float().abs().amax(dim=1, keepdim=True) / 448.0
            tensors[name] = (weight.float() / scale).to(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            tensors[name] = weight
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "quantization_config": config}, indent=2))
    return out


class Model:
    """One checkpoint at model level: its unquantized logits, then quantized variants."""

    def __init__(self, directory, sequences):
        from tpu_models.benchmarks import quant_quality
        self.qq, self.directory, self.sequences = quant_quality, directory, sequences
        base = quant_quality.build(directory)
        self.vocab_size = base.vllm_config.model_config.hf_config.vocab_size
        self.base_bytes = quant_quality.weight_bytes(base)
        self.base = self.log_probs(base)

    def log_probs(self, stepper) -> np.ndarray:
        logits = np.concatenate(self.qq.logits_of(stepper, self.sequences))
        return log_softmax(logits[:, :self.vocab_size])

    def quantized(self, quant, directory=None):
        stepper = self.qq.build(directory or self.directory, quant)
        return stepper, distances(self.base, self.log_probs(stepper))


@pytest.fixture(scope="module")
def demo_model():
    from tpu_models.benchmarks.quant_quality import demo_sequences
    return Model(DEMO, demo_sequences(DEMO, 8)[1])


def dtypes_by_shape(stepper) -> dict:
    out = {}
    for leaf in stepper.interface.state_leaves:
        out.setdefault(tuple(leaf.shape), set()).add(str(leaf.dtype))
    return out


def test_int4_and_fp8_kv_cache_on_the_demo_within_bounds(demo_model):
    hf = json.loads((DEMO / "config.json").read_text())
    V, D, F, L = hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    stepper, measured = demo_model.quantized("int4-weight-only")
    assert_within(measured, bounds(EPS["int4-weight-only"]), "demo int4-weight-only")
    leaves = stepper.interface.state_leaves
    assert sum(str(x.dtype) == "int4" for x in leaves) == 7 * L  # every projection
    by_shape = dtypes_by_shape(stepper)
    for shape in [(V, D), (D, V), (D, D), (D, )]:  # embedding, lm_head, structural_head, norms
        assert by_shape[shape] == {"float32"}, shape
    assert (D, F) in by_shape and by_shape[(D, F)] <= {"int4", "float32"}
    # int4 counts half a byte, as stored on TPU; 4 B per weight unquantized
    assert demo_model.qq.weight_bytes(stepper) < 0.35 * demo_model.base_bytes

    _, measured = demo_model.quantized("kv:fp8")
    assert_within(measured, bounds(EPS["kv:fp8"]), "demo fp8 KV cache")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_prequantized_fp8_checkpoint_loads_through_tpu_inference_methods(arch, request,
                                                                         tmp_path):
    model = request.getfixturevalue("demo_model" if arch == "qwen3" else "gemma3_model")
    checkpoint = write_fp8_checkpoint(Path(model.directory), tmp_path / "fp8")
    stepper, measured = model.quantized(None, checkpoint)
    assert_within(measured, bounds(EPS["fp8"]), f"{arch} compressed-tensors FP8 checkpoint")
    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    assert sum(str(x.dtype) == "float8_e4m3fn"
               for x in stepper.interface.state_leaves) == 7 * layers


@pytest.mark.parametrize("change, why", [
    ({"config_groups": {"group_0": {**FP8_DYNAMIC["config_groups"]["group_0"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}},
     "compressed-tensors scheme group_0 (weights int8 channel"),
    ({"ignore": ["structural_head"]}, "lm_head is quantized"),
])
def test_unsupported_prequantized_checkpoints_are_refused_by_name(change, why, tmp_path):
    from tpu_models.benchmarks.quant_quality import build
    checkpoint = write_fp8_checkpoint(DEMO, tmp_path / "ckpt", {**FP8_DYNAMIC, **change})
    with pytest.raises(prequantized.UnsupportedQuantization, match=re.escape(why)) as error:
        build(checkpoint)
    assert str(checkpoint) in str(error.value)


def test_qwix_rules_on_a_prequantized_checkpoint_are_refused(tmp_path):
    from tpu_models.benchmarks.quant_quality import build
    checkpoint = write_fp8_checkpoint(DEMO, tmp_path / "fp8")
    with pytest.raises(prequantized.UnsupportedQuantization, match="already quantized"):
        build(checkpoint, "int8")


def test_kv_cache_dtype_our_attention_cannot_store_is_refused_by_name():
    from tpu_models.benchmarks.quant_quality import build
    with pytest.raises(ValueError, match="--kv-cache-dtype int8_per_token_head is not supported"):
        build(DEMO, "kv:int8_per_token_head")


@pytest.fixture(scope="module")
def gemma3_decisive(tmp_path_factory):
    """Gemma 3 with one local and one global layer and decisive logits: embedding
    std 0.2 (tied, it is also the vocabulary projection), median top-1 margin
    ~2.7 nats, while the layers still carry the residual stream."""
    directory = make_gemma3(tmp_path_factory.mktemp("gemma3"), num_layers=2, sliding_window=16)
    config = json.loads((directory / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(directory / "model.safetensors")
    tensors["model.embed_tokens.weight"] *= 4
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def random_sequences(vocab_size: int, num: int = 8, length: int = 48) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(num)]


@pytest.fixture(scope="module")
def gemma3_model(gemma3_decisive):
    return Model(gemma3_decisive, random_sequences(384))


@pytest.mark.parametrize("preset", ["int8-weight-only", "int8", "fp8"])
def test_gemma3_presets_within_bounds(gemma3_model, preset):
    _, measured = gemma3_model.quantized(preset)
    assert_within(measured, bounds(EPS[preset]), f"gemma3 {preset}")


# --- every preset through the real `vllm serve` ----------------------------------

SERVED = [  # (preset, model, extra server arguments, environment): each preset once, both models
    ("int8-weight-only", "qwen3", [], {}),
    ("int8", "qwen3", [], {}),
    ("fp8", "qwen3", ["--kv-cache-dtype", "fp8"], {}),
    # Gemma 3's local layers in their own (window) KV-cache groups, in fp8, through
    # the TPU attention path (RPA v3's fp8 cache layout and scales; docs/tpu-path.md)
    ("int4-weight-only", "gemma3", ["--kv-cache-dtype", "fp8"],
     {"TPU_MODELS_ATTENTION": "rpa-reference"}),
]


class ServerQueue:
    """The servers of the selected SERVED cases, each launched while the one
    before it is being tested: a start-up (mostly imports, one core) overlaps
    the previous server's requests instead of following them."""

    def __init__(self, selected: list[int], directories: dict, log_dir: Path):
        self.selected, self.directories, self.log_dir = selected, directories, log_dir
        self.servers = {}

    def launch(self, index: int) -> None:
        from tpu_models.harness.serve_process import Server
        if index in self.servers:
            return
        preset, arch, extra, env = SERVED[index]
        vocab_size = json.loads((self.directories[arch] / "config.json").read_text())["vocab_size"]
        self.servers[index] = Server(
            self.directories[arch], "--quant", preset, *extra, "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "8", "--max-logprobs", str(vocab_size),
            "--kv-cache-memory-bytes", str(32 * 2**20), "--served-model-name", "tiny",
            env={"SKIP_JAX_PRECOMPILE": "1", **env}, log=self.log_dir / f"serve-{preset}.log").launch()

    def prefetch(self, index: int) -> None:
        """Launches this case's server and the next selected one's."""
        self.launch(index)
        later = [i for i in self.selected if i > index]
        if later:
            self.launch(later[0])

    def server(self, index: int):
        self.prefetch(index)
        return self.servers[index].start()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module", autouse=True)
def served(request, tmp_path_factory):
    """Launches the first selected server before this module's first test, so
    that its start-up overlaps the model-level tests."""
    selected = sorted(item.callspec.params["index"] for item in request.session.items
                      if item.name.startswith("test_preset_served_by_vllm"))
    directories = {"qwen3": DEMO}
    if any(SERVED[i][1] == "gemma3" for i in selected):
        directories["gemma3"] = request.getfixturevalue("gemma3_decisive")
    queue = ServerQueue(selected, directories, tmp_path_factory.mktemp("serve-logs"))
    if selected:
        queue.launch(selected[0])
    yield queue
    queue.stop()


@pytest.fixture(scope="module")
def expectations(gemma3_decisive):
    """Per model, cached: sequences, prompts, and what unquantized transformers
    predicts for them (log-probabilities at every position, greedy tokens)."""
    cache = {}

    def get(arch: str) -> dict:
        if arch not in cache:
            if arch == "qwen3":
                from tpu_models.benchmarks.quant_quality import demo_sequences
                directory = DEMO
                prompts, sequences = demo_sequences(DEMO, 8)
            else:
                directory, sequences = gemma3_decisive, random_sequences(384)
                prompts = [s[:24] for s in sequences]
            reference = Reference(directory)
            cache[arch] = {
                "sequences": sequences, "prompts": prompts, "vocab_size": reference.vocab_size,
                "log_probs": np.concatenate([log_softmax(reference.logits(s)[:-1])
                                             for s in sequences]),
                "greedy": [reference.greedy(p, GREEDY_TOKENS) for p in prompts]}
        return cache[arch]

    return get


def served_log_probs(server, sequences, vocab_size) -> np.ndarray:
    """Full-vocabulary next-token log-probabilities at every prompt position [P, V]."""

    async def run():
        client = server.async_client()
        return await asyncio.gather(*[client.completions.create(
            model="tiny", prompt=s, max_tokens=1, temperature=0,
            extra_body={"prompt_logprobs": vocab_size}) for s in sequences])

    rows = []
    for reply in asyncio.run(run()):
        for position in reply.choices[0].prompt_logprobs[1:]:
            row = np.full(vocab_size, -np.inf)
            for token, entry in position.items():
                row[int(token)] = entry["logprob"]
            rows.append(row)
    return np.array(rows)


def served_greedy(server, prompts, max_tokens) -> list[list[int]]:
    async def run():
        client = server.async_client()
        return await asyncio.gather(*[client.completions.create(
            model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True}) for p in prompts])

    return [r.choices[0].token_ids for r in asyncio.run(run())]


def prefix_agreement(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return same / len(a)


@pytest.mark.e2e
@pytest.mark.parametrize("index", range(len(SERVED)), ids=[p for p, *_ in SERVED])
def test_preset_served_by_vllm_within_bounds(index, served, expectations):
    preset, arch, extra, env = SERVED[index]
    served.prefetch(index)  # start-up overlaps the reference computation
    expected = expectations(arch)
    server = served.server(index)
    try:
        assert "Applying Qwix quantization" in server.output()
        # The ready line names the attention path, the preset's types and the cache's.
        weights = {"int8-weight-only": "weight int8", "int8": "act int8, weight int8",
                   "fp8": "act float8_e4m3fn, weight float8_e4m3fn",
                   "int4-weight-only": "weight int4"}[preset]
        said = f"attention {env.get('TPU_MODELS_ATTENTION', 'portable')}, Qwix {weights}"
        said += ", KV cache fp8)" if "fp8" in extra else ")"
        assert said in server.output(), said
        log_probs = served_log_probs(server, expected["sequences"], expected["vocab_size"])
        greedy = served_greedy(server, expected["prompts"], GREEDY_TOKENS)
    finally:
        server.stop()
    eps = math.hypot(EPS[preset], EPS["kv:fp8"] if "fp8" in extra else 0)
    bound = bounds(eps, expected["log_probs"])
    assert_within(distances(expected["log_probs"], log_probs), bound,
                  f"served {arch} {preset} {' '.join(extra)}")
    agreement = np.mean([prefix_agreement(a, b) for a, b in zip(expected["greedy"], greedy)])
    print(f"greedy prefix agreement {agreement:.3f} (bound {bound['greedy_prefix']:.3f})")
    assert agreement >= bound["greedy_prefix"]
