"""`tpu-models export`: checkpoint conversions (the work lives in loaders/)."""

import argparse
import json
import signal
import sys

from tpu_models.loaders.hf import CheckpointError
from tpu_models import registry


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models export")
    sub = p.add_subparsers(dest="kind", required=True)
    merge = sub.add_parser("lora-merge", help="merge a PEFT LoRA adapter into its base checkpoint")
    merge.add_argument("base", help="HF checkpoint directory the adapter was trained on")
    merge.add_argument("adapter", help="PEFT adapter directory (adapter_config.json + "
                                       "adapter_model.safetensors)")
    merge.add_argument("--out", required=True, help="directory to create")
    merge.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    maxtext = sub.add_parser("maxtext", help="a MaxText checkpoint (scanned or not) -> HF")
    maxtext.add_argument("checkpoint", help="MaxText run directory, checkpoints/, <step>/ or "
                                            "items/ (local or gs://)")
    maxtext.add_argument("--model", required=True, choices=registry.export_names("maxtext"),
                         help="the architecture the run trained, which picks the name table")
    maxtext.add_argument("--out", required=True, help="directory or gs:// prefix to create")
    maxtext.add_argument("--tokenizer", help="directory with the tokenizer files to ship")
    maxtext.add_argument("--dtype", choices=["bfloat16", "float32"],
                         help="weights dtype (default: the checkpoint's)")
    maxtext.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                         help="config.json field the checkpoint cannot tell (e.g. sliding_window=4, "
                              "rope_parameters={...}); sizes come from the tensors")
    maxtext.add_argument("--scan", choices=["auto", "scanned", "unscanned"], default="auto",
                         help="layer layout to expect (default: detect)")
    maxtext.add_argument("--param-scan-axis", type=int, default=1,
                         help="layer axis of scanned tensors (MaxText's param_scan_axis)")
    maxtext.add_argument("--max-shard-size", type=int, default=2**30, metavar="BYTES",
                         help="shard size; peak memory is about this plus the largest tensor")
    maxtext.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    tunix = sub.add_parser("tunix", help="a Tunix checkpoint (full weights or qwix LoRA) -> HF")
    tunix.add_argument("checkpoint", help="Tunix checkpoint: root, <step> or <step>/model_params "
                                          "(local or gs://)")
    tunix.add_argument("--base", required=True,
                       help="HF checkpoint the run started from (config, tokenizer; the "
                            "weights LoRA merges into)")
    tunix.add_argument("--lora-alpha", type=float,
                       help="LoRA alpha of the run (Tunix does not store it)")
    tunix.add_argument("--adapter-only", action="store_true",
                       help="write a PEFT adapter (for `tpu-models serve --lora`) instead of "
                            "merged weights")
    tunix.add_argument("--dtype", choices=["bfloat16", "float32"], help="cast weights (default: keep)")
    tunix.add_argument("--out", required=True, help="directory or gs:// prefix to create")
    tunix.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    for arch in registry.architectures():
        if (mm := arch.multimodal) is not None:
            text = sub.add_parser(mm.export_name, help=f"the language model of a {mm.hf_name} "
                                                       f"checkpoint, as a text-only {arch.hf_name}")
            text.add_argument("source", help=f"{mm.hf_name} checkpoint directory")
            text.add_argument("--out", required=True, help="directory to create")
            text.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    examples = sub.add_parser(
        "examples", help="small, real MaxText (unscanned and scanned) and Tunix (full and "
                         "LoRA) checkpoints from the demo's weights, to try the others on "
                         "(docs/export.md)")
    examples.add_argument("out", help="directory to write them into")
    return p


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare string
    return out


def _terminated(signum, frame):
    # Unwinds through HfWriter, which removes its temporary dir (gs://: what it uploaded).
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        if args.kind == "lora-merge":
            from tpu_models.loaders.exporter.convert import lora_merge
            out = lora_merge(args.base, args.adapter, args.out,
                             arch=registry.for_checkpoint(args.base), overwrite=args.overwrite)
        elif args.kind == "maxtext":
            from tpu_models.loaders.exporter.convert import maxtext
            out = maxtext(args.checkpoint, registry.by_export_name(args.model), args.out,
                          tokenizer=args.tokenizer,
                          dtype=args.dtype, overrides=_overrides(args.set), scan=args.scan,
                          scan_axis=args.param_scan_axis, overwrite=args.overwrite,
                          max_shard_bytes=args.max_shard_size, progress="maxtext -> HF")
        elif args.kind == "tunix":
            from tpu_models.loaders.exporter.convert import tunix
            out = tunix(args.checkpoint, args.base, args.out,
                        arch=registry.for_checkpoint(args.base), lora_alpha=args.lora_alpha,
                        adapter_only=args.adapter_only, dtype=args.dtype,
                        overwrite=args.overwrite, progress="tunix -> HF")
        elif args.kind == "examples":
            from tpu_models.loaders.exporter.examples import write_examples
            from tpu_models.server.serve import DEFAULT_MODEL
            demo = registry.for_checkpoint(DEFAULT_MODEL)
            qwen3 = registry.by_export_name("qwen3")
            config = json.loads((DEFAULT_MODEL / "config.json").read_text())
            for path in write_examples(DEFAULT_MODEL, args.out, maxtext=demo.maxtext,
                                       tunix=qwen3.tunix,
                                       base_shapes=qwen3.hf_table(config)[0]):
                print(f"wrote {path}")
            return
        else:  # a multimodal release's language model
            from tpu_models.loaders.exporter.convert import text_only
            arch = next(a for a in registry.architectures()
                        if a.multimodal and a.multimodal.export_name == args.kind)
            out = text_only(args.source, args.out, arch=arch, overwrite=args.overwrite)
        print(f"wrote {out}")
    except (CheckpointError, ValueError) as e:
        sys.exit(f"tpu-models export: {e}")
