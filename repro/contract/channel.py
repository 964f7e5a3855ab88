"""The structured channel from a case process to its parent: JSON lines with a schema, in a file of their own beside
the process's free-form log (`<case>.channel.jsonl`, named to the process in REPRO_CHANNEL), so that no log text can
look like a record and no record hides in the log. Every writer (the attention-layer worker, the spec-decode case,
the vLLM gate process and the plugin inside vLLM) emits through `emit`; every reader (repro.judge.classify, the vLLM
gate's annotation) reads a `Channel`.

A record: {"schema": 1, "tag": one of repro.contract.tags.TAGS, "pid": the writer's pid, "data": {...}}. A record whose
data holds "error" is an error whatever its tag (an install error printed under the auditor's tag once went unseen).
A line that is not a record of this schema is a channel problem, reported, never skipped silently.

Without REPRO_CHANNEL (a process started by hand) `emit` prints `<TAG> <json>` on stdout, the format of the records
written before the channel existed; `Channel.from_output` reads those, so the recorded logs in results/ stay
readable."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from repro.contract.tags import TAGS
from repro.errors import MissingKey

ENV = "REPRO_CHANNEL"
SCHEMA = 1
SUFFIX = ".channel.jsonl"


def emit(tag: str, data: dict) -> None:
    """Write one record (appended whole: one write of one line, so concurrent writers of one process never mix)."""
    if tag not in TAGS:
        raise ValueError(f"unknown channel tag {tag!r}; repro.contract.tags.TAGS lists them")
    path = os.environ.get(ENV)
    if not path:
        print(f"{tag} {json.dumps(data, default=str)}", flush=True)
        return
    write_record(path, tag, data)


def write_record(path: str | Path, tag: str, data: dict) -> None:
    """Append one record to the channel file at `path` (emit's write; the parent writes one with it where a record
    stands in for a process, as the gate's kept reference does)."""
    # a leading newline: a record another writer left cut short (killed mid-write) cannot swallow this one
    line = "\n" + json.dumps({"schema": SCHEMA, "tag": tag, "pid": os.getpid(), "data": data}, default=str) + "\n"
    buf = memoryview(line.encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while buf:  # a short write (a full disk, a signal) continues, never leaves half a record unnoticed
            buf = buf[os.write(fd, buf) :]
    finally:
        os.close(fd)


def path_for(out_log: str | Path) -> Path:
    """The channel file beside a case's output log (`<case>.out.log` -> `<case>.channel.jsonl`)."""
    p = Path(out_log)
    return p.with_name(p.name.removesuffix(".out.log") + SUFFIX)


@dataclass(frozen=True)
class Record:
    tag: str
    data: dict
    pid: int | None = None


@dataclass
class Channel:
    records: list[Record] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # lines that are not records of this schema
    source: str = "channel"  # channel: the file; output: tagged lines of a log written before the channel

    def of(self, tag: str) -> list[dict]:
        return [r.data for r in self.records if r.tag == tag]

    def last(self, tag: str) -> dict | None:
        found = self.of(tag)
        return found[-1] if found else None

    def errors(self) -> list[str]:
        """Every error any record carries, whatever its tag, and every malformed line."""
        errs = [f"{r.tag}: {r.data['error']}" for r in self.records if "error" in r.data]
        return errs + [f"channel: {p}" for p in self.problems]

    @classmethod
    def read(cls, path: str | Path) -> Channel:
        ch = cls()
        try:
            text = Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return ch  # the process wrote nothing (it died before its first record)
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                ch.problems.append(f"line {n} is not JSON: {line[:80]!r} (a record cut short?)")
                continue
            if not isinstance(obj, dict) or obj.get("schema") != SCHEMA or not isinstance(obj.get("data"), dict):
                ch.problems.append(f"line {n} is not a schema-{SCHEMA} record: {line[:80]!r}")
                continue
            if obj.get("tag") not in TAGS:
                ch.problems.append(f"line {n} has an unknown tag {obj.get('tag')!r}")
                continue
            ch.records.append(Record(obj["tag"], obj["data"], obj.get("pid")))
        return ch

    @classmethod
    def from_output(cls, text: str) -> Channel:
        """The `<TAG> <json>` lines of a process's output (records before the channel, or a hand-started process)."""
        ch = cls(source="output")
        for line in text.splitlines():
            tag, _, rest = line.partition(" ")
            if tag not in TAGS:
                continue
            try:
                data = json.loads(rest)
            except json.JSONDecodeError:
                continue  # free text that starts like a tag: not a record
            if isinstance(data, dict):
                ch.records.append(Record(tag, data))
        return ch

    @classmethod
    def of_case(cls, out_log: str | Path, output: str | None = None) -> Channel:
        """A case's channel: its channel file when it has one, else the tagged lines of its output."""
        path = path_for(out_log)
        if path.exists():
            return cls.read(path)
        return cls.from_output(output if output is not None else _read(out_log))


# What a recorded record predates: a key of its data that no process writes (or, ATTEMPTS, that the gate's report
# writes in a results.json row). Only the replays' upgrader of recorded runs (repro.report.records: upgrade_channel,
# upgrade_gate_row) marks an old record so, and only what it marks is read as it was read then; a live record missing
# a key is a MissingKey (has), judged as cannot-vouch or error, never as harmless.
RECORDED_BEFORE = "recorded_before"
CONFIGURATION = "configuration"  # a reference RESULT record from before references reported their configuration
COMPILATION = "compilation_mode"  # an ENGINE record from before the engine's compilation mode was reported
DESCRIPTOR_CHECK = "descriptor_check"  # counters from before the auditor's descriptor check (descriptor_checks, ...)
SPEC_LAYOUT = "spec_layout"  # counters from before the plugin reported vLLM's spec-decode layout (spec_layout_known)
BACKENDS = "backends"  # counters from before forwards were counted per backend (attention_forwards: FLASH_ATTN's)
ACCEPTANCE = "acceptance"  # an ENGINE record without the draft's acceptance counters (references ran no draft then)
ATTEMPTS = "attempts"  # a gate results.json row from before it kept each attempt of its case (gate.process.Attempt)
# a gate row of a self control's further attempt, clean as its process ended, from before a further attempt was
# compared with its reference as the first is: its verdict is its process's own (CaseResult.first_verdict)
UNCOMPARED = "uncompared_attempt"


def recorded_before(record: dict | None) -> tuple[str, ...]:
    """What the replays' upgrader marked this record as predating (empty for every live record)."""
    return tuple((record or {}).get(RECORDED_BEFORE) or ())


def has(record: dict | None, key: str, mark: str, what: str) -> bool:
    """Does `record` (`what`, for the message) hold `key`: True; False where the replays' upgrader marked it as
    predating `mark` (a recorded run, read as it was then); a live record without the key raises MissingKey."""
    if key in (record or {}):
        return True
    if mark in recorded_before(record):
        return False
    raise MissingKey(f"{what} lacks {key!r} (a live record missing a key its writer always writes: not trusted)")


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""
