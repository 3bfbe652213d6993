"""`python -m service.tokenizer export DIR`: the served model's tokenizer as a Hugging Face
tokenizer directory, for clients that tokenize locally (AutoTokenizer, lm-eval)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.config import ConfigError, load_settings
from service.model.errors import ModelLoadError
from service.model.files import (
    check_model_path,
    default_model_path,
    gguf_metadata,
    read_gguf,
    read_hf_config,
    tokenizer_of,
)
from service.model.tokenizer_export import export_tokenizer


def context_length(path: Path) -> int:
    """The model's longest input: the directory's `model_max_length`."""
    if path.is_dir() and (path / "config.json").is_file():
        return read_hf_config(path)[0].max_position_embeddings
    if path.is_dir():
        path = next(iter(sorted(path.glob("*.gguf"))), path)
    from service.model.loader_gguf import config_from_gguf  # imports torch: only when needed

    return config_from_gguf(gguf_metadata(read_gguf(path)), str(path)).max_position_embeddings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.tokenizer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export", help="write tokenizer.json, tokenizer_config.json, special_tokens_map.json")
    export.add_argument("dir", type=Path, help="output directory (created if missing)")
    export.add_argument("--model-path", help="a checkpoint directory or .gguf file "
                        "(default: MODEL_PATH, else the embedded SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    try:
        model_path = args.model_path or load_settings().model_path
        check_model_path(model_path)
        path = Path(model_path) if model_path else default_model_path()
        written = export_tokenizer(tokenizer_of(path), args.dir, context_length(path))
    except (ConfigError, ModelLoadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the tokenizer of {path} to {args.dir}: "
          + ", ".join(p.name for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
