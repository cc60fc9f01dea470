"""Golden generations as syrupy snapshots under ``golden/``, one readable JSON file per numerics class.

A golden is keyed by numerics class (``cpu-float32``, ``cuda-sm90-bfloat16`` ...), prompt set and
kv_codec -- never by backend: every backend under test must reproduce the same tokens. Files live in
``golden/generation/<class>/<prompt-set>.<kv_codec>.json``; ``pytest --snapshot-update`` writes them,
and the diff is reviewed like code.

Goldens are read from the package (``mla_conformance.goldens``: the checkout's ``golden/`` in an editable
install) and written only in a source checkout; elsewhere ``--snapshot-update`` is an error saying so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from syrupy.extensions.json import JSONSnapshotExtension

from mla_conformance.errors import MLAInputError
from mla_conformance.resources import check_goldens_writable, golden_root

GOLDEN_DIR = golden_root() / "generation"


def golden_path(numerics_class: str, prompt_set: str, kv_codec: str) -> Path:
    return GOLDEN_DIR / numerics_class / f"{prompt_set}.{kv_codec}.json"


def read_golden(path: Path) -> dict[str, Any] | None:
    """The stored golden, None when absent; a corrupt file raises naming itself."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MLAInputError(f"{path}: corrupt golden file ({exc}); restore it from git or regenerate it with "
                            "`pytest suites/test_generation_golden.py --snapshot-update` and review the diff") from None
    if not isinstance(data, dict) or not isinstance(data.get("outputs"), list):
        raise MLAInputError(f"{path}: corrupt golden file (no 'outputs' list); restore it from git or regenerate "
                            "it with --snapshot-update")
    return data


def dump_golden(data: dict[str, Any]) -> str:
    """Indented JSON with each token list on one line, so a golden diff reads prompt by prompt."""
    text = json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False)
    return re.sub(r"\[\s+(-?\d+(?:,\s+-?\d+)*)\s+\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def golden_extension(numerics_class: str, prompt_set: str, kv_codec: str):
    """A syrupy extension class whose one snapshot is ``golden_path(...)``."""
    target = golden_path(numerics_class, prompt_set, kv_codec)

    class GoldenJSON(JSONSnapshotExtension):
        @classmethod
        def dirname(cls, *, test_location) -> str:
            return str(target.parent)

        @classmethod
        def discovery_dirname(cls, *, test_location) -> str:
            return str(target.parent)

        @classmethod
        def get_snapshot_name(cls, *, test_location, index=0) -> str:
            return target.name.removesuffix(".json")

        @classmethod
        def matches_test_location(cls, *, test_location, snapshot_location) -> bool:
            return True  # goldens are shared by every backend's test of that class: never "unused"

        def serialize(self, data, **kwargs) -> str:
            return dump_golden(data)

        @classmethod
        def write_snapshot_collection(cls, *, snapshot_collection, **kwargs) -> None:
            check_goldens_writable()  # never into an installed package
            super().write_snapshot_collection(snapshot_collection=snapshot_collection, **kwargs)

    return GoldenJSON


def golden_payload(result: dict[str, Any], numerics_class: str, prompt_set: str) -> dict[str, Any]:
    """What a golden holds: readable tokens and text per prompt, no backend, no timings."""
    return {"numerics_class": numerics_class, "prompt_set": prompt_set, "kv_codec": result["kv_codec"],
            "model": Path(result["model"]).name,
            "outputs": [{"id": o["id"], "tokens": o["tokens"], **({"text": o["text"]} if "text" in o else {})}
                        for o in result["outputs"]]}
