"""Read named tensors from a safetensors checkpoint directory, with errors that name file and tensor.

Supports a single ``model.safetensors``, several ``*.safetensors`` shards, and the sharded
``model.safetensors.index.json`` layout. Only the tensors asked for are read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

from mla_conformance.errors import CheckpointError
from mla_conformance.model.config import MLAConfig, expected_shapes


class SafetensorsCheckpoint:
    """A directory of safetensors files, indexed by tensor name (headers only are read up front)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.exists():
            raise CheckpointError(f"{self.directory}: no such checkpoint directory")
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory (a checkpoint is a directory "
                                  "holding config.json and *.safetensors)")
        self._where: dict[str, Path] = {}
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            for name, fname in weight_map.items():
                self._where[name] = self.directory / fname
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no *.safetensors file and no "
                                      "model.safetensors.index.json: not a safetensors checkpoint")
            for f in files:
                for name in self._header(f):
                    self._where.setdefault(name, f)

    @staticmethod
    def _header(path: Path) -> dict:
        """Parse a safetensors header ourselves first, so a corrupt file names itself."""
        try:
            size = path.stat().st_size
            with path.open("rb") as fh:
                raw = fh.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
                (n,) = struct.unpack("<Q", raw)
                if n > size - 8 or n > 100 * 2**20:
                    raise CheckpointError(f"{path}: corrupt safetensors header (claims {n} header bytes, "
                                          f"file has {size})")
                header = json.loads(fh.read(n))
        except CheckpointError:
            raise
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise CheckpointError(f"{path}: truncated safetensors file: header says {8 + n + end} bytes, "
                                  f"file has {size}")
        return {k: v for k, v in header.items() if k != "__metadata__"}

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is not in the checkpoint") from None

    def read(self, names: Iterable[str]) -> dict:
        """Read the given tensors (and only those) with safetensors' own loader."""
        from safetensors import safe_open

        names = list(names)
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of(name), []).append(name)
        out = {}
        for path, wanted in by_file.items():
            if not path.exists():
                raise CheckpointError(f"{path}: shard listed in the index is missing (needed for {wanted[0]!r})")
            self._header(path)
            try:
                with safe_open(str(path), framework="pt") as fh:
                    for name in wanted:
                        out[name] = fh.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot read tensor(s) {wanted} ({exc})") from None
        return {name: out[name] for name in names}


#: Files one of which a Hugging Face tokenizer needs.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def validate_checkpoint(directory: str | Path, *, layer: int = 1) -> None:
    """Check a checkpoint directory once, before any test: config, weights and tokenizer.

    Reads headers only. Raises one CheckpointError, one line, naming each of config / weights /
    tokenizer that is missing or corrupt (and the file).
    """
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (a checkpoint is a directory holding config.json, "
                              "*.safetensors and a tokenizer)")
    problems: list[str] = []
    config = None
    cfg = directory / "config.json"
    if not cfg.is_file():
        problems.append("config missing (no config.json)")
    else:
        try:
            config = MLAConfig.from_hf(cfg)
        except Exception as exc:  # MLAInputError naming the field, or a JSON error
            problems.append(f"config corrupt ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
    try:
        ckpt = SafetensorsCheckpoint(directory)
    except CheckpointError as exc:
        text = str(exc)
        problems.append(("weights missing (" if "no *.safetensors" in text else "weights corrupt (") + text + ")")
    else:
        if config is not None:
            hf = f"model.layers.{layer}.self_attn."
            v3 = f"layers.{layer}.attn."
            if not any(n.startswith((hf, v3)) for n in ckpt.names()):
                problems.append(f"weights incomplete (no layer-{layer} attention tensors {hf}*)")
            else:
                missing = [hf + n for n in expected_shapes(config) if hf + n not in ckpt]
                if missing and not any(n.startswith(v3) for n in ckpt.names()):
                    problems.append(f"weights incomplete ({', '.join(missing)} not in the checkpoint)")
    present = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
    if not present:
        problems.append("tokenizer missing (none of " + ", ".join(TOKENIZER_FILES) + ")")
    elif "tokenizer.json" in present:
        try:
            json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            problems.append(f"tokenizer corrupt ({directory / 'tokenizer.json'}: {str(exc).splitlines()[0]})")
    if problems:
        raise CheckpointError(f"{directory}: not a usable checkpoint: " + "; ".join(problems))
