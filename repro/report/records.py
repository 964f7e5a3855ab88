"""The recorded runs under results/: each record a folder as the harness wrote it, or that folder packed into one
`NAME.tar.xz` (`pack`); both read the same way (`members`, `unpack`). The index (results/index.json, `build_index`)
says for every record, present or left in git history, which command it ran, the commit its code was at, when, which
builds, and what it shows in one line, all derived from the record's own files (repro.report.record_summary) and git,
never written by hand. `records --add` packs new records and writes the index all or nothing
(repro.report.records_add)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

from repro.case.spec import (
    CUDA_ERROR,
    PLATFORM_FAILED,
    REFUSED,
    RERUN_ALONE,
    STALLED,
    UNTRUSTED_REFERENCE,
    CaseResult,
)
from repro.contract.channel import (
    ACCEPTANCE,
    ATTEMPTS,
    BACKENDS,
    COMPILATION,
    CONFIGURATION,
    DESCRIPTOR_CHECK,
    RECORDED_BEFORE,
    SPEC_LAYOUT,
    UNCOMPARED,
    recorded_before,
)
from repro.contract.tags import COUNTERS_TAG, ENGINE_TAG, FIRST_STALE, RESULT_TAG
from repro.files import load_json
from repro.judge.classify import CUDA_MARKERS
from repro.judge.classify import REFUSED as REFUSED_WORDS
from repro.report.record_summary import describe, indexed
from repro.run.process import STALLED as STALLED_WORDS

PACKED = ".tar.xz"
INDEX = "index.json"
# results/'s files that are not records: summaries generated from them, the source check's data (read by repro)
NOT_RECORDS = {"README.md", INDEX}
GENERATED_BY = "python -m repro records --index"


def records(results: Path) -> dict[str, Path]:
    """Record name -> where it is: its folder (a new record, not packed yet) or its NAME.tar.xz; a name held both ways
    is the folder's (the newer). A hidden name is none (the temporaries of `add`)."""
    found: dict[str, Path] = {}
    for p in sorted(Path(results).iterdir()):
        if p.name.startswith("."):
            continue
        if p.name.endswith(PACKED) and p.is_file():
            found.setdefault(p.name[: -len(PACKED)], p)
        elif p.is_dir():
            found[p.name] = p
    return found


def pack(folder: Path) -> Path:
    """Pack a record folder into FOLDER.tar.xz beside it and remove the folder (packed: its bytes)."""
    import shutil  # rmtree: only when packing

    folder = Path(folder)
    out = folder.with_name(folder.name + PACKED)
    out.write_bytes(packed(folder))
    shutil.rmtree(folder)
    return out


def first_link(folder: Path) -> Path | None:
    """The first symbolic link under `folder` (never followed), or None."""
    for top, dirs, files in os.walk(folder):
        for n in sorted(dirs + files):
            if Path(top, n).is_symlink():
                return Path(top, n)
    return None


def packed(folder: Path) -> bytes:
    """A record folder packed as NAME.tar.xz holds it, the same bytes for the same files (sorted, no owners, no
    times). Its members are NAME/... ."""
    if link := first_link(folder):  # what it points to is never packed
        raise ValueError(f"{link}: a symbolic link: a record holds files only")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=6) as tar:
        for p in [folder, *sorted(folder.rglob("*"))]:
            info = tarfile.TarInfo(str(p.relative_to(folder.parent)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if p.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif p.is_file():
                data = p.read_bytes()
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _safe_members(tar: tarfile.TarFile, name: str) -> list[tarfile.TarInfo]:
    """The archive's members, each a file or folder under NAME/ (anything else is not a record of ours)."""
    members = tar.getmembers()
    for m in members:
        parts = Path(m.name).parts
        if not parts or parts[0] != name or ".." in parts or not (m.isfile() or m.isdir()):
            raise ValueError(f"{name}{PACKED}: {m.name!r} is not a file under {name}/")
    return members


def unpack(archive: Path, dest: Path) -> Path:
    """Extract a packed record into dest/NAME and return that folder."""
    archive = Path(archive)
    name = archive.name[: -len(PACKED)]
    with tarfile.open(archive, "r:xz") as tar:
        safe = _safe_members(tar, name)  # members checked; the "data" filter too where Python has it (3.12's warning)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=safe, filter="data")
        else:
            tar.extractall(dest, members=safe)  # noqa: S202
    return Path(dest) / name


def members(where: Path, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """The record's files whose path inside it (`sub/results.json`) `wanted` accepts: path -> bytes, from its folder
    or its archive alike."""
    where = Path(where)
    if where.is_dir():
        return {
            rel: p.read_bytes()
            for p in sorted(where.rglob("*"))
            if p.is_file() and wanted(rel := p.relative_to(where).as_posix())
        }
    name = where.name[: -len(PACKED)]
    out = {}
    with tarfile.open(where, "r:xz") as tar:
        for m in _safe_members(tar, name):
            rel = Path(m.name).relative_to(name).as_posix()
            if m.isfile() and wanted(rel):
                out[rel] = tar.extractfile(m).read()
    return out


def git(root: Path, *args: str) -> str:
    """A git command's output in root ('' when it fails: no checkout, no such commit)."""
    r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def added(root: Path, name: str) -> tuple[str, str] | None:
    """(commit, date) of the commit that first added the record, folder or archive: the code it was recorded with."""
    log = git(root, "log", "--diff-filter=A", "--format=%H%x09%aI", "--", f"results/{name}", f"results/{name}{PACKED}")
    return tuple(log.splitlines()[-1].split("\t")) if log else None  # type: ignore[return-value]


def _last_present(root: Path, name: str) -> str | None:
    """The last commit that held a record no longer in the tree: HEAD, or the parent of the commit that removed it."""
    if any(_exists(root, f"HEAD:results/{name}{end}") for end in ("", PACKED)):
        return git(root, "rev-parse", "HEAD")
    gone = git(root, "log", "-1", "--diff-filter=D", "--format=%H", "--", f"results/{name}", f"results/{name}{PACKED}")
    return git(root, "rev-parse", f"{gone}^") if gone else None


def _exists(root: Path, spec: str) -> bool:
    return subprocess.run(["git", "-C", str(root), "cat-file", "-e", spec], capture_output=True).returncode == 0


def _in_history(root: Path) -> set[str]:
    """Every record name git history holds under results/ (folders and archives; not results/'s own files)."""
    names = set()
    for path in git(root, "log", "--format=", "--name-only", "--", "results/").splitlines():
        parts = path.split("/")
        if len(parts) > 2:
            names.add(parts[1])
        elif len(parts) == 2 and parts[1].endswith(PACKED):
            names.add(parts[1][: -len(PACKED)])
    return names


def _from_git(root: Path, commit: str, name: str) -> dict[str, bytes]:
    """A record's index files as they were at a commit (a record left in history; folder or archive)."""
    listing = git(root, "ls-tree", "-r", "--name-only", commit, "--", f"results/{name}/", f"results/{name}{PACKED}")
    out = {}
    for path in listing.splitlines():
        blob = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{path}"], capture_output=True).stdout
        if path.endswith(PACKED):  # read as an archive of its own name (members checks each path under NAME/)
            with tempfile.TemporaryDirectory(prefix="repro-record-") as d:
                (tmp := Path(d) / f"{name}{PACKED}").write_bytes(blob)
                return members(tmp, indexed)
        rel = path[len(f"results/{name}/") :]
        if indexed(rel):
            out[rel] = blob
    return out


def build_index(
    root: Path,
    notes: dict[str, str] | None = None,
    described: dict[str, dict] | None = None,
    packing: Collection[str] = (),
) -> dict:
    """results/index.json's content for the checkout at root: every record in results/ (packed or a folder), and every
    record the previous index or git history names that is gone from the tree, with the commit it was last present
    at. `notes` (name -> one line) adds what its files cannot say to a record's entry; a note stays until replaced.
    `described`: records in results/ already described (name -> describe), read once; `packing`: folders `add` packs,
    stored as their NAME.tar.xz."""
    root = Path(root)
    results = root / "results"
    old = load_index(results)
    present = records(results)
    names = set(present) | set(old) | _in_history(root)
    head = git(root, "rev-parse", "HEAD") or None
    out = []
    for name in sorted(names):
        entry = dict(old.get(name, {}))
        if name in present:
            where = present[name]
            entry.update((described or {}).get(name) or describe(members(where, indexed)))
            stored = where.with_name(name + PACKED) if name in packing else where
            entry["stored"] = stored.relative_to(root).as_posix() + ("/" if stored.is_dir() else "")
            entry["last_present"] = None
        elif not entry.get("last_present"):
            last = _last_present(root, name)
            if not last:
                continue
            entry.update(describe(_from_git(root, last, name)))
            entry["stored"], entry["last_present"] = None, last
        first = added(root, name)
        entry["commit"], entry["added"] = first if first else (entry.get("commit") or head, entry.get("added"))
        entry["committed"] = bool(first)
        if notes and name in notes:
            entry["note"] = notes[name]
        out.append({"name": name, **{k: entry.get(k) for k in _FIELDS}})
    return {"generated_by": GENERATED_BY, "records": out}


_FIELDS = ("stored", "last_present", "commit", "committed", "added", "recorded", "commands", "builds", "shows", "note")
_FIELDS += ("harness_code",)  # the code its run says it ran (stale.code_at checks it against `commit`)


def load_index(results: Path) -> dict[str, dict]:
    """The index as written: name -> its entry (empty when there is none yet)."""
    path = Path(results) / INDEX
    if not path.exists():
        return {}
    return {e["name"]: e for e in load_json(path)["records"]}  # bounded in size and depth


# --- the one upgrader of recorded results ---------------------------------------------------------------------------
# What a case result written before typed flags (CaseResult.flags) said in its reason's words instead:
# its stall (the Stall watch's message first), the GPU's refusal (classify's message first), its rerun alone under an
# MPS daemon of its own (run.mps_cases' suffix). Read here, and only here: live records carry their flags.
_WORDS_OF_FLAG = (
    (STALLED, lambda reason: reason.startswith(STALLED_WORDS)),
    (REFUSED, lambda reason: reason.startswith(REFUSED_WORDS)),
    (RERUN_ALONE, lambda reason: "(rerun alone: " in reason),
)

# What a result written before these flags existed (results.json schema 4 and every replayed row) said in words: its
# reference's validation did not trust it, or it was judged against such a reference (the validation's and the
# comparison's reasons quote "reference not trusted"); a CUDA error in the line its reason quotes (classify's markers).
_WORDS_OF_LATER_FLAG = (
    (UNTRUSTED_REFERENCE, lambda reason: "reference not trusted" in reason),
    (CUDA_ERROR, lambda reason: any(m in reason for m in CUDA_MARKERS)),
)

# The history steps whose record, written before its typed mark, the upgrader marks: a failed platform check
# (PLATFORM_FAILED), a method its build lacks (CaseResult.not_applicable).
_PLATFORM_STEP, _NOT_APPLICABLE_STEP = "platform check", "not applicable"
_COMPARISON_STEP = "reference comparison"  # a gate row's comparison with its reference (UNCOMPARED where none)


def upgrade_result(result: dict, row: dict | None = None) -> dict:
    """A recorded case result (a results.json's `result`, matrix or gate) as this code writes one: one from before
    typed flags gets the flags its reason said in words (_WORDS_OF_FLAG; an untrusted reference's and a CUDA error's,
    flags of later, _WORDS_OF_LATER_FLAG, whatever flags it has), and the platform check's flag and the
    not-applicable why its history's step said (the only place a step's name is read back), one from before results kept their
    expectation gets its row's, a field added after it was written its default (what reading it gave before), its
    backend_identity's engine and counters the marks of what they predate (_upgraded, as upgrade_channel marks the
    records they came from). The one upgrader of recorded results: results.load_json calls it for a record of an
    older schema, the gate replays (tests/recorded_gate.py) for every recorded row; a result that has its flags keeps
    them (a live record never passes through here: it is never read leniently)."""
    out = dict(result)
    if out.get("expected") is None and (row or {}).get("expected"):  # older records kept it in the row only
        out["expected"] = row["expected"]
    reason = str(out.get("reason") or "")
    if "flags" not in out:
        out["flags"] = [flag for flag, said in _WORDS_OF_FLAG if said(reason)]
    later = [flag for flag, said in _WORDS_OF_LATER_FLAG if flag not in out["flags"] and said(reason)]
    out["flags"] = [*out["flags"], *later] if later else out["flags"]
    steps = {h.get("step"): h for h in out.get("history") or () if isinstance(h, dict)}
    if _PLATFORM_STEP in steps and PLATFORM_FAILED not in out["flags"]:  # from before the platform check's flag
        out["flags"] = [*out["flags"], PLATFORM_FAILED]
    if "not_applicable" not in out and _NOT_APPLICABLE_STEP in steps:  # from before its typed field: its step's why
        out["not_applicable"] = steps[_NOT_APPLICABLE_STEP].get("why")
    for f in dataclasses.fields(CaseResult):  # a field the result predates: its default, as it was read before
        if f.name not in out and f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.name not in out and f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    if isinstance(identity := out.get("backend_identity"), dict):  # the engine's and counters' records, as annotated
        tags = {"engine": ENGINE_TAG, "counters": COUNTERS_TAG}
        out["backend_identity"] = {k: _upgraded(tags.get(k, ""), v) or v for k, v in identity.items()}
        engine = out["backend_identity"].get("engine")  # its acceptance kept apart by annotate: judged from there
        if "spec_decode_num_draft_tokens" in (identity.get("acceptance") or {}) and isinstance(engine, dict):
            rest = {k: v for k, v in engine.items() if k != RECORDED_BEFORE}
            out["backend_identity"]["engine"] = _marked(rest, [m for m in recorded_before(engine) if m != ACCEPTANCE])
    return out


def upgrade_gate_row(row: dict) -> dict:
    """A recorded row of a gate results.json (gate.report.rows) as this code writes one: a row from before rows kept
    each attempt of their case (`attempts`, gate.process.Attempt) marked ATTEMPTS, so the replays read it as they read
    it then (each process remade from its row's result: a self control's first attempt is not in it where a later one's
    result was kept); a further attempt recorded clean with no comparison with its reference in its history (every
    clean case compared has one: the comparison adds its evidence) marked UNCOMPARED, its verdict its process's own.
    Used by the replays only; a live row lacking them is a MissingKey (gate.process.recorded_attempts)."""
    marks = [] if "attempts" in row else [ATTEMPTS]
    result = row.get("result") or {}
    compared = any(h.get("step") == _COMPARISON_STEP for h in result.get("history") or () if isinstance(h, dict))
    if (result.get("spec") or {}).get("attempt") and result.get("verdict") == "clean" and not compared:
        marks.append(UNCOMPARED)
    return _marked(row, marks)


# --- the one upgrader of recorded channel records -------------------------------------------------------------------
# Each mark (repro.contract.channel.RECORDED_BEFORE) says what a record predates; the judging reads a key a marked
# record lacks as it read it then, and a live record lacking it as a MissingKey (never harmless).
_COUNTERS_BEFORE = (("descriptor_checks", DESCRIPTOR_CHECK), ("spec_layout_known", SPEC_LAYOUT), ("backends", BACKENDS))


def _marked(data: dict, marks: list[str]) -> dict:
    return {**data, RECORDED_BEFORE: [*data.get(RECORDED_BEFORE, []), *marks]} if marks else data


def _upgraded(tag: str, data: dict) -> dict | None:
    """A recorded record's data with the marks of what it predates, or None when it predates nothing: a reference's
    RESULT without 'nonfinite' (CONFIGURATION), an ENGINE without 'compilation_mode' (COMPILATION) or the draft's
    acceptance (ACCEPTANCE), counters (COUNTERS, ENGINE's own) without the descriptor check's, layout's or backends';
    an attention-layer RESULT from before its first stale pass was typed given the one its first difference named."""
    if not isinstance(data, dict):
        return None
    marks = []
    if tag == RESULT_TAG and data.get("tokens") and "nonfinite" not in data:
        marks.append(CONFIGURATION)
    if tag == ENGINE_TAG and "compilation_mode" not in data:
        marks.append(COMPILATION)
    if tag == ENGINE_TAG and "spec_decode_num_draft_tokens" not in (data.get("acceptance") or {}):
        marks.append(ACCEPTANCE)
    new = dict(data)
    if tag == RESULT_TAG and isinstance(diffs := data.get("first_diffs"), list) and FIRST_STALE not in data:
        new[FIRST_STALE] = str(diffs[0]).split(":")[0] if diffs else None  # "<descriptor>: <difference>" then
    if tag == COUNTERS_TAG:
        new = _marked(new, [m for key, m in _COUNTERS_BEFORE if key not in data])
    elif tag == ENGINE_TAG and isinstance(data.get("counters"), dict):
        new["counters"] = _upgraded(COUNTERS_TAG, data["counters"]) or data["counters"]
    new = _marked(new, marks)
    return new if new != data else None


_TEXT_RECORD = re.compile(r"^(REPRO_[A-Z_]+) (\{.*\})$")


def upgrade_channel(text: str) -> str:
    """The one upgrader of recorded channel records, used by the replays only (a channel file's JSON lines, or a log's
    `TAG {json}` lines from before the channel): each record marked with what it predates (_upgraded). Live runs never
    pass through here: there a record missing a key is a MissingKey (repro.contract.channel.has)."""
    out = []
    for line in text.splitlines():
        if m := _TEXT_RECORD.match(line):
            try:
                data = json.loads(m[2])
            except ValueError:
                data = None
            if (new := _upgraded(m[1], data)) is not None:
                line = f"{m[1]} {json.dumps(new)}"
        elif line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict) and (new := _upgraded(rec.get("tag"), rec.get("data"))) is not None:
                line = json.dumps({**rec, "data": new})
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")
