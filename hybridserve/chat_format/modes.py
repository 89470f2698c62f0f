"""Which conversation format a checkpoint speaks (vLLM's ``--tokenizer-mode``)."""

from __future__ import annotations

import json
from pathlib import Path

MODES = ("auto", "hf", "deepseek_v4")
ENCODER_FILE = Path("encoding") / "encoding_dsv4.py"


def resolve_mode(folder: str | Path, requested: str = "auto") -> str:
    """``hf`` (the Jinja chat template) or ``deepseek_v4`` (our DeepSeek-V4 encoder); ``auto`` picks
    ``deepseek_v4`` for a ``deepseek_v4`` checkpoint that ships DeepSeek's encoder or no chat template."""
    if requested not in MODES:
        raise ValueError(f"--tokenizer-mode {requested!r} is not one of {', '.join(MODES)}")
    if requested != "auto":
        return requested
    folder = Path(folder)
    if _read(folder / "config.json").get("model_type") != "deepseek_v4":
        return "hf"
    ships_encoder = (folder / ENCODER_FILE).is_file()
    has_template = bool(_read(folder / "tokenizer_config.json").get("chat_template"))
    return "deepseek_v4" if ships_encoder or not has_template else "hf"


def _read(path: Path) -> dict[str, object]:
    return dict(json.loads(path.read_text())) if path.is_file() else {}
