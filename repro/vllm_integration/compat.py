"""Checks a vLLM source tree or wheel without importing it: the capture-defect source verdict, and whether the
auditor plugin's hooks (class, method and attribute names in the FlashAttention backend) are all there."""

from __future__ import annotations

import ast
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from repro.vllm_integration.source_check import check_tree

FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
NEEDED_FIELDS = ("query_start_loc", "seq_lens", "scheduler_metadata", "num_actual_tokens", "max_query_len")


@dataclass
class Compat:
    source: str
    verdict: str
    reason: str
    layout: str | None
    plugin_ok: bool
    plugin_notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def plugin_compat(root: Path) -> tuple[bool, list[str]]:
    path = root / FLASH_ATTN
    if not path.exists():
        return False, [f"{FLASH_ATTN} missing"]
    tree = ast.parse(path.read_text())
    classes = {c.name: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
    notes = []
    b = classes.get("FlashAttentionMetadataBuilder")
    if b is None or not any(isinstance(f, ast.FunctionDef) and f.name == "build" for f in b.body):
        notes.append("FlashAttentionMetadataBuilder.build not found")
    impl = classes.get("FlashAttentionImpl")
    fwd = next((f for f in impl.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None) if impl else None
    if fwd is None:
        notes.append("FlashAttentionImpl.forward not found")
    else:
        args = [a.arg for a in fwd.args.args]
        if args[:7] != ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata"]:
            notes.append(f"FlashAttentionImpl.forward arguments differ: {args[:7]}")
    meta = classes.get("FlashAttentionMetadata")
    have = (
        {t.target.id for t in meta.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
        if meta
        else set()
    )
    missing = [f for f in NEEDED_FIELDS if f not in have]
    if missing:
        notes.append(f"FlashAttentionMetadata lacks {', '.join(missing)}")
    return not notes, notes or [
        "builder.build, impl.forward(layer, query, key, value, kv_cache, attn_metadata) and "
        "metadata fields " + ", ".join(NEEDED_FIELDS) + " found"
    ]


def check_source(path: str | Path) -> Compat:
    """A checkout folder, or a vllm wheel (its Python files are read from the archive)."""
    from repro.descriptors import ConfigError

    path = Path(path)
    if path.suffix == ".whl":
        if not zipfile.is_zipfile(path):
            raise ConfigError(f"{path}: not a wheel (not a zip archive)")
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, tmp)
            return _check(Path(tmp), path.name)
    return _check(path, str(path))


def _check(root: Path, label: str) -> Compat:
    v = check_tree(root)
    ok, notes = plugin_compat(root)
    return Compat(label, v.verdict, v.reason, v.layout, ok, notes)
