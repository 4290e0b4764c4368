"""The commands that write files: a merged adapter, a recipe's dataset, a tiny model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpo_dist.cli.common import Command, bad_data_exits_2


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("adapter", help="a LoRA adapter directory in PEFT's layout (a run's final/adapter)")
    parser.add_argument("out", help="the directory to write the merged model to (new, or empty)")
    parser.add_argument(
        "--merge", action="store_true", required=True, help="merge the adapter into its base model (the one form)"
    )
    parser.add_argument("--base", help="the base model directory (default: the one the adapter's config names)")


def _export(args: argparse.Namespace) -> int:
    from grpo_dist.ops.export import merge_adapter

    adapted = merge_adapter(Path(args.adapter), Path(args.out), args.base)
    print(f"{adapted} adapted weights merged; the model in {args.out} loads in transformers and vLLM")
    return 0


def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    from grpo_dist.data.prepare import LAYOUTS

    parser.add_argument("layout", choices=sorted(LAYOUTS))
    parser.add_argument("source", help="a data file, a save_to_disk directory or a hub dataset id")
    parser.add_argument("out", help="JSON Lines file to write")
    parser.add_argument("--split", default=None, help="the split to read (the layout's own by default: gsm8k: train)")
    parser.add_argument("--subset", default=None, help="a hub dataset's subset (the layout's own on its hub id)")
    parser.add_argument("--revision", default=None, help="a hub dataset's branch, tag or commit (main by default)")


@bad_data_exits_2
def _prepare(args: argparse.Namespace) -> int:
    from grpo_dist.data.prepare import prepare

    out, repeated = prepare(args.layout, args.source, args.out, args.split, args.subset, args.revision)
    rows = out.read_text().splitlines()
    columns = ", ".join(json.loads(rows[0])) if rows else "no columns"
    left_out = f"; {repeated} repeated prompts left out" if repeated else ""
    print(f"{len(rows)} rows written to {out} ({columns}){left_out}")
    return 0


def _tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)


def _tiny_model(args: argparse.Namespace) -> int:
    from grpo_dist.models import build_tiny_model

    print(build_tiny_model(args.out_dir, seed=args.seed))
    return 0


COMMANDS: dict[str, Command] = {
    "export": Command(
        "a LoRA adapter merged into its base model: grpo-dist export ADAPTER_DIR OUT_DIR --merge [--base MODEL_DIR]",
        _export_arguments,
        _export,
    ),
    "prepare": Command(
        "a recipe's dataset as the rows a run reads: grpo-dist prepare gsm8k|math|dapo-math|aime|mbpp SOURCE OUT.jsonl",
        _prepare_arguments,
        _prepare,
    ),
    "tiny-model": Command(
        "write a random-init tiny Qwen2 model with a character tokenizer", _tiny_model_arguments, _tiny_model
    ),
}
