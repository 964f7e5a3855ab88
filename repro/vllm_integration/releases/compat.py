"""Checks a vLLM source tree or wheel without importing it: the capture-defect source verdict, whether the
auditor plugin's hooks (class, method and attribute names in the FlashAttention backend) are all there, and the
plugin facts of every attention backend the auditor has a table for (plugin_facts: names, flags and signatures
derived from the sources, never their text), recorded per release in results/vllm-versions.json."""

from __future__ import annotations

import ast
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from repro.errors import ConfigError
from repro.vllm_integration.plugin.backend_fields import BACKENDS, METADATA_ARG
from repro.vllm_integration.releases.source_check import SPEC_DIR, check_tree, spec_layout

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


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    if not path.exists():
        return {}
    return {c.name: c for c in ast.walk(ast.parse(path.read_text())) if isinstance(c, ast.ClassDef)}


def _methods(cls: ast.ClassDef | None) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in (cls.body if cls else []) if isinstance(f, ast.FunctionDef)}


def _tensor_fields(classes: dict[str, ast.ClassDef], name: str, prefix: str = "", depth: int = 0) -> list[str]:
    """The annotated tensor fields of a metadata class, and of the metadata classes of the same module its fields
    hold (FlashInfer's prefill/decode), as dotted paths."""
    out = []
    for stmt in classes[name].body if name in classes else []:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        ann = ast.unparse(stmt.annotation)
        if "Tensor" in ann:
            out.append(prefix + stmt.target.id)
        elif depth < 1:
            for inner in sorted({n.id for n in ast.walk(stmt.annotation) if isinstance(n, ast.Name)} & set(classes)):
                out += _tensor_fields(classes, inner, f"{prefix}{stmt.target.id}.", depth + 1)
    return sorted(set(out))


def _args(fn: ast.FunctionDef | None) -> list[str]:
    return [a.arg for a in fn.args.args + fn.args.kwonlyargs] if fn else []


def plugin_facts(root: Path) -> dict:
    """What the plugin needs from a vLLM tree, per backend with a table (backend_fields.BACKENDS): its builder and
    impl classes, where forward takes attn_metadata, the builder methods the auditor wraps, the metadata's tensor
    fields and those the table does not list; the V2 spec-decode layout and whether its draft loop refreshes the
    draft-decode metadata in place (in-graph refresh); the FA3 names the sm_margin and poison hooks use."""
    backends = {}
    for b in BACKENDS.values():
        path = root / (b.module.replace(".", "/") + ".py")
        classes = _classes(path)
        builder, impl = _methods(classes.get(b.builder)), _methods(classes.get(b.impl))
        fields = _tensor_fields(classes, b.metadata)
        args = _args(impl.get("forward"))
        backends[b.name] = {
            "module_found": path.exists(),
            "builder_build": "build" in builder,
            "impl_forward_takes_attn_metadata": len(args) > METADATA_ARG and args[METADATA_ARG] == "attn_metadata",
            "build_for_cudagraph_capture": "build_for_cudagraph_capture" in builder,
            "update_draft_decode_metadata": "update_draft_decode_metadata" in builder,
            "metadata_tensor_fields": fields,
            "unlisted_fields": sorted(f for f in fields if not b.listed(f)),
        }
    refresh_calls = sorted(
        str(p.relative_to(root))
        for p in (root / SPEC_DIR).rglob("*.py")
        if ".update_draft_decode_metadata(" in p.read_text()
    )
    flash = root / BACKENDS["FLASH_ATTN"].module.replace(".", "/")
    flash_tree = ast.parse(flash.with_suffix(".py").read_text()) if flash.with_suffix(".py").exists() else None
    imported = {a.asname or a.name for n in ast.walk(flash_tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    iface = _classes_and_functions(root / "vllm/vllm_flash_attn/flash_attn_interface.py")
    return {
        "layout": spec_layout(root),
        "backends": backends,
        "in_graph_refresh_callers": refresh_calls,
        "fa3_hooks": {
            "get_scheduler_metadata_in_flash_attn": "get_scheduler_metadata" in imported,
            "sm_margin_in_get_scheduler_metadata": "sm_margin" in _args(iface.get("get_scheduler_metadata")),
        },
    }


def _classes_and_functions(path: Path) -> dict[str, ast.FunctionDef]:
    if not path.exists():
        return {}
    return {f.name: f for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef)}


def _python_tree(path: Path, tmp: str) -> Path:
    """The tree to read: a checkout folder as it is, a wheel's Python files extracted into tmp."""
    if path.suffix != ".whl":
        return path
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"{path}: not a wheel (not a zip archive)")
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                z.extract(name, tmp)
    return Path(tmp)


def check_source(path: str | Path) -> Compat:
    """A checkout folder, or a vllm wheel (its Python files are read from the archive)."""
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        return _check(_python_tree(path, tmp), path.name if path.suffix == ".whl" else str(path))


def source_facts(path: str | Path) -> dict:
    """plugin_facts of a checkout folder or a vllm wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        return plugin_facts(_python_tree(Path(path), tmp))


def _check(root: Path, label: str) -> Compat:
    """The verdict of the tree at root, named by `label` (what the user gave: never a temporary extraction folder)."""
    v = check_tree(root)
    ok, notes = plugin_compat(root)
    return Compat(label, v.verdict, v.reason.replace(str(root), label), v.layout, ok, notes)
