"""compute-sanitizer memcheck's log, parsed (what repro.judge.classify reads of a case under memcheck): each error's
access, kernel and where it points (Finding), the report (SanitizerReport); whether the first error is written out
yet (first_finding_complete: the runner stops a case once it is). The command line and environment that produce the
log: repro.run.sanitizer."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_ACCESS = re.compile(r"Invalid (__global__|__shared__|__local__) (read|write) of size (\d+) bytes")
_AT = re.compile(r"^\s*at (.+?)\+0x[0-9a-f]+", re.I)
_WHERE = re.compile(r"is ([\d,]+) bytes (after|before) the nearest allocation at 0x[0-9a-f]+ of size ([\d,]+) bytes")
_INSIDE = re.compile(r"is inside the nearest allocation at 0x[0-9a-f]+ of size ([\d,]+) bytes")
_FRAME = re.compile(r"^\s*Device Frame: ?(.+?)(?:\+0x[0-9a-f]+)?(?: in \S+:\d+)?$")
_SUMMARY = re.compile(r"ERROR SUMMARY: ([\d,]+) error")
_API = re.compile(r"Program hit (\w+) \(error \d+\) due to \"([^\"]+)\" on CUDA API call to (\w+)")


_KERNEL_NAMES = re.compile(
    r"(FlashAttnFwdCombine|FlashAttnFwdSm\d+|prepare_varlen_num_blocks_kernel|flash_fwd_combine\w*)"
)


def short_kernel(name: str) -> str:
    """The FA3 class or kernel a long templated name is about."""
    m = _KERNEL_NAMES.search(name)
    return m[1] if m else name[:48]


def kernel_role(name: str) -> str:
    """combine (split-KV combine), main (FA3 forward), prepare (scheduler metadata), or other."""
    n = name.lower()
    if "combine" in n:
        return "combine"
    if "prepare_varlen" in n:
        return "prepare"
    if "flashattnfwd" in n or "flash_fwd" in n or "flash::" in n:
        return "main"
    return "other"


@dataclass(frozen=True)
class Finding:
    kernel: str
    role: str
    access: str  # e.g. "global read of 4 bytes"
    relation: str | None  # after | before | inside | None
    bytes_off: int | None  # bytes past (after) or before the nearest allocation
    alloc_size: int | None
    count: int

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        where = ""
        if self.relation in ("after", "before"):
            where = f", {self.bytes_off} bytes {self.relation} a {self.alloc_size}-byte allocation"
        elif self.relation == "inside":
            where = f", inside a {self.alloc_size}-byte allocation"
        return f"{self.role} kernel {short_kernel(self.kernel)}: {self.access}{where} x{self.count}"


@dataclass
class SanitizerReport:
    findings: list[Finding]
    error_summary: int | None
    api_errors: list[str]

    @property
    def has_errors(self) -> bool:
        return bool(self.findings) or bool(self.error_summary)

    def first_role(self) -> str | None:
        return self.findings[0].role if self.findings else None


def _num(s: str) -> int:
    return int(s.replace(",", ""))


def parse_log(text: str) -> SanitizerReport:
    """Group memcheck errors by (kernel, access, relation, allocation size); keep first-seen order."""
    groups: dict[tuple, list] = {}
    cur: dict | None = None

    def close() -> None:
        if cur and cur.get("kernel"):
            key = (cur["kernel"], cur["access"], cur.get("relation"), cur.get("alloc"))
            g = groups.setdefault(key, [cur.get("off"), 0])
            g[1] += 1
            if cur.get("off") is not None and (g[0] is None or cur["off"] > g[0]):
                g[0] = cur["off"]

    summary, api = None, []
    for line in text.splitlines():
        line = re.sub(r"^=========\s?", "", line)
        if m := _ACCESS.search(line):
            close()
            cur = {"access": f"{m[1].strip('_')} {m[2]} of {m[3]} bytes"}
        elif cur is not None and "kernel" not in cur and (m := _AT.match(line)):
            cur["kernel"] = cur["at"] = m[1].strip()
        elif cur is not None and (m := _FRAME.match(line)):
            cur["kernel"] = m[1].strip()  # the outermost device frame is the kernel itself
        elif cur is not None and (m := _WHERE.search(line)):
            cur.update(relation=m[2], off=_num(m[1]), alloc=_num(m[3]))
        elif cur is not None and (m := _INSIDE.search(line)):
            cur.update(relation="inside", alloc=_num(m[1]))
        elif (m := _SUMMARY.search(line)) and summary is None:
            summary = _num(m[1])
        elif m := _API.search(line):
            api.append(f"{m[3]}: {m[2]}")
    close()
    findings = [Finding(k[0], kernel_role(k[0]), k[1], k[2], off, k[3], n) for k, (off, n) in groups.items()]
    return SanitizerReport(findings, summary, api)


_BLOCK_END = re.compile(r"\n=+ *\n")  # memcheck ends each error's block with a bare "=========" line


def first_finding_complete(text: str) -> bool:
    """Has memcheck finished writing its first error (the access, the kernel, where it points)?"""
    i = text.find("Invalid ")
    return i >= 0 and _BLOCK_END.search(text, i) is not None
