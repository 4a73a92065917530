"""`tpu-models export`: checkpoint conversions (the work lives in loaders/)."""

import argparse
import sys

from loaders.hf import CheckpointError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models export")
    sub = p.add_subparsers(dest="kind", required=True)
    merge = sub.add_parser("lora-merge", help="merge a PEFT LoRA adapter into its base checkpoint")
    merge.add_argument("base", help="HF checkpoint directory the adapter was trained on")
    merge.add_argument("adapter", help="PEFT adapter directory (adapter_config.json + "
                                       "adapter_model.safetensors)")
    merge.add_argument("--out", required=True, help="directory to create")
    merge.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    text = sub.add_parser("gemma3-text", help="the language model of a multimodal Gemma 3 "
                                              "checkpoint, as a text-only Gemma3ForCausalLM")
    text.add_argument("source", help="Gemma3ForConditionalGeneration checkpoint directory")
    text.add_argument("--out", required=True, help="directory to create")
    text.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return p


def gemma3_text_config(source: str) -> dict:
    """The full text config of a multimodal Gemma 3 checkpoint, defaults filled in."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(source)
    if getattr(config, "architectures", [None])[0] != "Gemma3ForConditionalGeneration":
        raise ValueError(f"{source}: not a Gemma3ForConditionalGeneration checkpoint")
    text = config.text_config.to_dict()
    text["dtype"] = str(getattr(config, "dtype", None) or text.get("dtype") or "bfloat16").replace(
        "torch.", "")
    return text


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    try:
        if args.kind == "lora-merge":
            from loaders.export import lora_merge
            out = lora_merge(args.base, args.adapter, args.out, overwrite=args.overwrite)
        elif args.kind == "gemma3-text":
            from loaders.export import gemma3_text
            out = gemma3_text(args.source, args.out, gemma3_text_config(args.source),
                              overwrite=args.overwrite)
        print(f"wrote {out}")
    except (CheckpointError, ValueError) as e:
        sys.exit(f"tpu-models export: {e}")
