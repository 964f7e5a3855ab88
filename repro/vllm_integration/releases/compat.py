"""Checks a vLLM source tree or wheel without importing it: the capture-defect source verdict, whether the
auditor plugin's hooks (class, method and attribute names in the FlashAttention backend) are all there, and the
plugin facts of every attention backend the auditor has a table for (plugin_facts: names, flags and signatures
derived from the sources, never their text), recorded per release in results/vllm-versions.json.

The source check reads code patterns; it cannot vouch. Its answer (`vllm-check`) says what it rests on: the pattern
found or not found (source_check), which release the sources say they are and what their files were checked against
(`files`, files_checked: a wheel's files against its own RECORD, an installed folder's against its dist-info RECORD, a
git checkout's status at an exact release tag), and whether the gate ran that release on a GPU
(results/vllm-gpu-records.json names the gate record of each release: gpu_record). None of those checks compares the
files with the published release's: a patched wheel whose RECORD was written again matches its own RECORD, and a tag
can be made anywhere; this project records no hashes of the published wheels to compare with. So vllm-check never says
`good` nor that files are the published ones: sources with no known bad pattern read NO_KNOWN_BAD, "no known bad
pattern (not run on a GPU)", exit 0 (`git bisect run` keeps working), the JSON saying `verified: false`, the release's
GPU record named beside it. The one answer the GPU record gives: a release the gate found affected reads `bad` for files
that are as their own RECORD or tag says (a false alarm costs a GPU run; a false all-clear would hide the bug)."""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import re
import subprocess
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from repro import CHECKOUT
from repro.errors import ConfigError
from repro.vllm_integration.plugin import SPEC_DIR, spec_layout
from repro.vllm_integration.plugin.backend_fields import BACKENDS, METADATA_ARG
from repro.vllm_integration.releases.source_check import BAD, GOOD, NO_KNOWN_BAD, check_tree

GPU_RECORDS = CHECKOUT / "results" / "vllm-gpu-records.json"  # release -> the gate record that answered it on a GPU
PACKED = ".tar.xz"  # a record packed (repro.report.records.pack): NAME.tar.xz holding NAME/...
VERDICT_WORDS = {NO_KNOWN_BAD: "no known bad pattern (not run on a GPU)"}  # never "good": the module docstring

FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
NEEDED_FIELDS = ("query_start_loc", "seq_lens", "scheduler_metadata", "num_actual_tokens", "max_query_len")


@dataclass
class Compat:
    source: str
    verdict: str  # GOOD, BAD (a known bad pattern, or the GPU record), NO_KNOWN_BAD, or untestable
    reason: str
    layout: str | None
    plugin_ok: bool
    plugin_notes: list[str] = field(default_factory=list)
    pattern: str | None = None  # the pattern verdict of the code alone (source_check: good, bad, untestable)
    patterns: list[str] = field(default_factory=list)  # every capture manager read, with the pattern found or not
    release: str | None = None  # which release the sources say they are (None: not said)
    files: str = "unknown"  # what the files were checked against and how it came out (files_checked)
    gpu_record: dict | None = None  # {"release", "answer": good|bad, "record": results/<dir>} of the release
    # does a GPU record of these very files stand behind the verdict? Only a comparison with the published release's
    # files could say so, and this project records none: false
    verified: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> list[str]:
        """The answer in words (vllm-check): the verdict and why, every capture manager with the pattern found or
        not, the release and its files, the GPU record, the auditor's hooks."""
        rec = f"{_found(self.gpu_record)} on a GPU ({self.gpu_record['record']})" if self.gpu_record else "none"
        return [
            f"{self.source}: {VERDICT_WORDS.get(self.verdict, self.verdict)} ({self.layout or '-'}): {self.reason}",
            *(f"  pattern: {line}" for line in self.patterns),
            f"  release {self.release or 'not named'}; files: {self.files}; GPU record of the release: {rec}",
            f"  auditor hooks: {'ok' if self.plugin_ok else 'MISSING'}: {'; '.join(self.plugin_notes)}",
        ]


def _found(rec: dict) -> str:
    """What a release's GPU record found, in words that never read as these files' verdict."""
    return "found affected" if rec["answer"] == BAD else "found clean"


def plugin_compat(root: Path) -> tuple[bool, list[str]]:
    path = root / FLASH_ATTN
    if not path.exists():
        return False, [f"{FLASH_ATTN} missing"]
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError) as e:  # sources this Python cannot read: no hook is known to be there
        return False, [f"{FLASH_ATTN} does not parse ({type(e).__name__}: {e})"]
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
        tree = _python_tree(path, tmp)
        return _check(tree, path.name if path.suffix == ".whl" else str(path), *files_checked(path))


def source_facts(path: str | Path) -> dict:
    """plugin_facts of a checkout folder or a vllm wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        return plugin_facts(_python_tree(Path(path), tmp))


def _check(root: Path, label: str, release: str | None = None, files: str = "unknown", as_said: bool = False) -> Compat:
    """The answer for the tree at root, named by `label` (what the user gave: never a temporary extraction folder):
    the pattern verdict, then what it rests on (the module docstring); `as_said`: the files are as their own RECORD or
    release tag says (files_checked), never known to be the published release's."""
    v = check_tree(root)
    ok, notes = plugin_compat(root)
    pattern = NO_KNOWN_BAD if v.verdict == GOOD else v.verdict  # what the code alone shows: never "good"
    c = Compat(label, v.verdict, v.reason.replace(str(root), label), v.layout, ok, notes, pattern, v.evidence)
    c.release, c.files = release, files
    c.gpu_record = gpu_record(release) if release else None
    if v.verdict == BAD:
        c.reason = f"known bad pattern: {c.reason}"
    if v.verdict != GOOD:  # a bad pattern needs no GPU to say so; untestable sources stay untestable
        return c
    rec = c.gpu_record
    if rec and rec["answer"] == BAD and as_said:  # never verified: the published files were found affected
        c.verdict = BAD
        c.reason = (
            f"the gate found {release} affected on a GPU ({rec['record']}) and these files {files}: read as that "
            f"release; no known bad pattern in them: {c.reason}"
        )
        return c
    why = (
        f"no GPU record of {release or 'these sources (no release named)'}"
        if not rec
        else f"{release} has a GPU record ({_found(rec)}, {rec['record']}), but these files were not compared with "
        f"its published files ({files})"
    )
    c.verdict, c.reason = NO_KNOWN_BAD, f"unverified, not run on a GPU ({why}); {c.reason}"
    return c


def gpu_records(table: Path | None = None) -> dict[str, Path]:
    """release -> where the gate record that ran it on a GPU is: results/vllm-gpu-records.json names it (read here
    and nowhere else: vllm-check's answer and docs/versions.md's table both ask this), present in this checkout as a
    folder (not packed yet) or NAME.tar.xz. A release whose record is absent is left out; {} without the table."""
    table = GPU_RECORDS if table is None else table
    try:
        named = json.loads(table.read_text())
    except (OSError, ValueError):
        return {}
    found = {}
    for release, name in named.items() if isinstance(named, dict) else ():
        if isinstance(name, str):
            where = next((p for p in (table.parent / name, table.parent / f"{name}{PACKED}") if p.exists()), None)
            if where is not None:
                found[release] = where
    return found


def record_name(where: Path) -> str:
    """A record's name, from its folder or its archive."""
    return where.name.removesuffix(PACKED)


def _results_json(where: Path) -> dict:
    """A gate record's results.json, from its folder or its archive; OSError or ValueError when it has none or cannot
    be read (an archive that is not xz, or cut short, included)."""
    if where.is_dir():
        return json.loads((where / "results.json").read_text())
    import lzma  # only for a packed record
    import tarfile  # only for a packed record

    try:
        with tarfile.open(where, "r:xz") as tar:
            member = tar.extractfile(f"{record_name(where)}/results.json")
            data = member.read() if member is not None else b""
    except KeyError as e:
        raise OSError(f"{where}: no results.json") from e
    except (EOFError, lzma.LZMAError, tarfile.TarError) as e:
        raise OSError(f"{where}: not a readable record archive ({e})") from e
    return json.loads(data)


def gpu_record(release: str, records: Path | None = None) -> dict | None:
    """The gate's answer for a release on a GPU (gpu_records: the record that ran it; its results.json's rows of that
    release, one per speculative method, self controls aside): BAD when any row is affected, GOOD when every row is
    not affected and was judged (`ok`: a row the gate could not vouch for is no answer), else None. None too when no
    record names the release, or the record is not in this checkout or cannot be read."""
    where = gpu_records(records).get(release)
    try:
        doc = _results_json(where) if where is not None else None
    except (OSError, ValueError):
        return None
    rows = [
        b
        for b in (doc or {}).get("builds", [])
        if (b.get("build") == release or str(b.get("build", "")).startswith(f"{release} "))
        and b.get("role") != "self-control"
    ]
    if any(b.get("affected") for b in rows):
        answer = BAD
    elif rows and all(b.get("ok") is True for b in rows):
        answer = GOOD
    else:
        return None
    return {"release": release, "answer": answer, "record": f"results/{record_name(where)}"}


def _sha256(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


OWN_RECORD = "match {}: not compared with the published wheel"  # every vllm/*.py as its RECORD lists it


def _against_record(record: str, files: dict[str, bytes], whose: str) -> tuple[str, bool]:
    """The vllm/ Python files against a RECORD's hashes (`whose`: which RECORD, in words): (what came of it, whether
    they match it). A match says nothing of the published release: a RECORD is written again with a patch."""
    listed = dict(line.split(",")[:2] for line in record.splitlines() if line.count(",") >= 2)
    changed = sorted(n for n, data in files.items() if n in listed and listed[n] != _sha256(data))
    extra = sorted(n for n in files if n not in listed)
    if not changed and not extra:
        return OWN_RECORD.format(whose), True
    parts = [
        f"{len(changed)} changed (first {changed[0]})" if changed else "",
        f"{len(extra)} not in RECORD" if extra else "",
    ]
    return f"differ from {whose}: " + ", ".join(p for p in parts if p), False


def _dist_release(name: str) -> str | None:
    """The release of a dist-info folder's name (vllm-0.34.0.dist-info -> 0.34.0)."""
    m = re.fullmatch(r"vllm-(.+)\.dist-info", name)
    return m.group(1) if m else None


def files_checked(path: Path) -> tuple[str | None, str, bool]:
    """(the release these sources say they are, what their files were checked against and how it came out, whether
    they are as that says): a wheel against its own RECORD, an installed folder (vllm/ beside vllm-X.dist-info)
    against its dist-info RECORD, a git checkout by its status at an exact release tag; "unknown: why" when none of
    these can tell. None of them is a comparison with the published release's files (the module docstring)."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            rec = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
            if rec is None:
                return None, "unknown: the wheel has no RECORD", False
            files = {n: z.read(n) for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")}
            return _dist_release(rec.split("/")[0]), *_against_record(z.read(rec).decode(), files, "its own RECORD")
    infos = sorted(path.glob("vllm-*.dist-info"))
    if infos and (infos[-1] / "RECORD").exists():
        files = {str(f.relative_to(path)): f.read_bytes() for f in (path / "vllm").rglob("*.py")}
        record = (infos[-1] / "RECORD").read_text()
        return _dist_release(infos[-1].name), *_against_record(record, files, "their dist-info RECORD")
    git = ["git", "-C", str(path)]
    try:
        top = subprocess.run([*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
        if Path(top.stdout.strip()).resolve() != path.resolve():
            raise subprocess.CalledProcessError(1, "git")  # a folder inside another repository is no vLLM checkout
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "vllm"], capture_output=True, text=True, check=True
        )
        tag = subprocess.run([*git, "describe", "--tags", "--exact-match"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return None, "unknown: no RECORD (wheel or dist-info) and not a git checkout", False
    release = m.group(1) if (m := re.fullmatch(r"v?(\d+\.\d+\.\d+)", tag.stdout.strip())) else None
    if dirty.stdout.strip():
        return release, f"differ: git status shows {len(dirty.stdout.splitlines())} changed file(s) under vllm/", False
    if not release:
        return None, "unknown: a git commit that is no release tag", False
    return release, f"clean at tag {tag.stdout.strip()}: not compared with the published release", True
