"""`cephalo export`: a checkpoint's weights as whole tensors (safetensors), or as a `transformers` model."""

from __future__ import annotations

import argparse

from cephalo.train.export import export_checkpoint

EPILOG = """\
examples:
  cephalo export runs/demo --out demo.safetensors                 # newest checkpoint of a run
  cephalo export --checkpoint runs/demo/checkpoints/step_000040 --out w.safetensors
  cephalo export runs/hf-gpt2 --hf runs/hf-gpt2/export           # transformers directory
  cephalo export runs/qwen --hf qwen-finetuned                    # + the source's tokenizer
  cephalo export runs/lora --peft my-adapter                      # a LoRA run's adapters

The safetensors file holds every parameter once, fp32, named `<unit>.<param>` (e.g.
`blocks.0.attn.c_attn.weight`). `--hf DIR` writes config.json + model.safetensors (fp32) that
`AutoModelForCausalLM.from_pretrained(DIR)` loads, for every Hugging Face model (a model
directory or an hf-* preset; the source directory's tokenizer files are copied along) and
for the built-in GPT (as GPT-2).
`--peft DIR` (a LoRA / QLoRA run) writes adapter_config.json + adapter_model.safetensors that
`PeftModel.from_pretrained(base, DIR)` loads; `--hf DIR` of such a run writes the base with the
adapters merged in (QLoRA: merged into the dequantized NF4 base, not the original weights).
A LoRA checkpoint holds only the adapters: the base is read again from the model directory.
The checkpoint may come from any plan or world size: export runs in one process.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="export a checkpoint to safetensors / transformers",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="a run directory, a checkpoint root, or one step_N checkpoint",
    )
    p.add_argument("--checkpoint", metavar="DIR", default=None, help="the same as SOURCE")
    p.add_argument(
        "--out", metavar="FILE", default=None, help="write the weights to this .safetensors file"
    )
    p.add_argument("--hf", metavar="DIR", default=None, help="write a transformers model directory")
    p.add_argument(
        "--peft",
        metavar="DIR",
        default=None,
        help="write a LoRA run's adapters as a PEFT directory",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cephalo.errors import CephaloError
    from cephalo.log import init_logging, logger

    init_logging()
    source = args.source or args.checkpoint
    if source is None:
        raise CephaloError(
            "export: give a run directory or checkpoint (SOURCE or --checkpoint DIR)"
        )
    if args.source and args.checkpoint and args.source != args.checkpoint:
        raise CephaloError(
            "export: give the checkpoint once (SOURCE or --checkpoint), not two different ones"
        )
    r = export_checkpoint(source, args.out, args.hf, args.peft)
    where = " and ".join(str(p) for p in (r.out, r.hf_dir, args.peft) if p is not None)
    logger.info(
        "exported %s step %d (%s, %.2fM parameters) to %s",
        r.checkpoint,
        r.step,
        r.model,
        r.num_params / 1e6,
        where,
    )
    if r.copied:
        logger.info("copied from the model directory: %s", ", ".join(r.copied))
    if r.peft_copied:
        logger.info("with the adapters: %s", ", ".join(r.peft_copied))
    elif args.peft:
        logger.info(
            "the run's tokenizer has no files (data.tokenizer = byte / bpe): the adapter "
            "directory holds the adapters only"
        )
    return 0
