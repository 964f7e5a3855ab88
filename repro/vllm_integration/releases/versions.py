"""Which vLLM releases each feature of the harness supports, from what was recorded of their wheels on the CPU tier:
results/vllm-source-check.json (the source check's verdict and layout, `python -m repro vllm-check WHEEL... --json`)
and results/vllm-versions.json (each wheel's torch pin and the plugin facts of compat.plugin_facts, written by this
module). `markdown()` is docs/versions.md's table; a CPU test keeps the two equal, and re-derives the record from
the real wheels when REPRO_VLLM_WHEELS names a folder of them.

  python -m repro.vllm_integration.releases.versions WHEEL... [--out results/vllm-versions.json]"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zipfile
from pathlib import Path

from repro import CHECKOUT
from repro.files import write_whole
from repro.vllm_integration.plugin import KNOWN_SPEC_LAYOUTS
from repro.vllm_integration.plugin.backend_fields import BACKENDS
from repro.vllm_integration.releases import compat
from repro.vllm_integration.releases.bisect import torch_pin
from repro.vllm_integration.releases.compat import record_name, source_facts

RESULTS = CHECKOUT / "results"
FACTS_FILE = RESULTS / "vllm-versions.json"
SOURCE_FILE = RESULTS / "vllm-source-check.json"


def wheel_version(name: str) -> str:
    """The release a wheel's file name carries (vllm-0.23.0-2-cp38-... -> 0.23.0)."""
    parts = Path(name).name.split("-")
    if len(parts) < 3 or parts[0] != "vllm":
        raise ValueError(f"{name}: not a vllm wheel file name (vllm-<version>-...whl)")
    return parts[1]


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


def torch_pin_of(path: str | Path) -> str | None:
    """The torch release a wheel pins (its dist-info METADATA: `Requires-Dist: torch==X`), or a checkout (its
    requirements/); bisect.torch_pin reads it, as the overlay check does. None when nothing says."""
    path = Path(path)
    if path.suffix != ".whl":
        return torch_pin(path)[0]
    with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory() as tmp:
        meta = next((n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            return None
        z.extract(meta, tmp)
        return torch_pin(tmp)[0]


def row(wheel: str | Path) -> dict:
    """One release's record: the wheel, its version and torch pin, the plugin facts (compat.source_facts: read,
    never imported)."""
    return {
        "wheel": Path(wheel).name,
        "version": wheel_version(wheel),
        "torch_pin": torch_pin_of(wheel),
    } | source_facts(wheel)


def record(wheels: list[str | Path]) -> list[dict]:
    """The record of each wheel (row), in release order."""
    return sorted((row(w) for w in wheels), key=lambda r: version_key(r["version"]))


def load(path: Path = FACTS_FILE) -> list[dict]:
    return json.loads(path.read_text())


def _auditor(facts: dict) -> str:
    missing = [
        what
        for what, ok in (
            ("module", facts["module_found"]),
            ("builder.build", facts["builder_build"]),
            ("forward(..., attn_metadata)", facts["impl_forward_takes_attn_metadata"]),
        )
        if not ok
    ]
    if missing:
        return "no: " + ", ".join(missing) + " not found"
    if facts["unlisted_fields"]:
        return f"yes, {len(facts['unlisted_fields'])} unlisted fields checked by the rule"
    return f"yes ({len(facts['metadata_tensor_fields'])} tensor fields)"


def _refresh(row: dict) -> str:
    if not row["in_graph_refresh_callers"]:
        return "none (rebuilt per draft step)"
    hooked = [n for n, b in row["backends"].items() if b["update_draft_decode_metadata"]]
    rest = [n for n in row["backends"] if n not in hooked]
    return "hooked: " + (", ".join(hooked) or "none") + (f"; rebuilt: {', '.join(rest)}" if rest else "")


def _layout(layout: str | None) -> str:
    if layout is None:
        return "none (cannot vouch)"
    return f"`{layout}`" if layout in KNOWN_SPEC_LAYOUTS else f"`{layout}` (unknown: cannot vouch)"


def _fa3_hooks(h: dict) -> str:
    if h["get_scheduler_metadata_in_flash_attn"] and h["sm_margin_in_get_scheduler_metadata"]:
        return "yes"
    return "no: " + ", ".join(k for k, ok in h.items() if not ok)


def gpu_records(table: Path | None = None) -> dict[str, list[str]]:
    """release -> the names of the gate records under results/ that ran it on a GPU (compat.gpu_records, the one
    reader of results/vllm-gpu-records.json). Every other release's verdict is predicted from its sources."""
    return {release: [record_name(where)] for release, where in compat.gpu_records(table).items()}


def measured(version: str | None, records: dict[str, list[str]] | None = None) -> str:
    """What a release's verdict rests on: `measured` with its GPU records, else `predicted` (its sources read)."""
    records = gpu_records() if records is None else records
    if version and records.get(version):
        runs = records[version]
        return f"measured on the H200 (results/{runs[0]}" + (f" and {len(runs) - 1} more)" if len(runs) > 1 else ")")
    return "predicted: read from its sources, never run on a GPU"


def markdown(facts: list[dict] | None = None, sources: list[dict] | None = None) -> str:
    """docs/versions.md's table: per release, the source check's verdict, the spec-decode layout (and whether the
    plugin knows it), the auditor per backend, the in-graph draft-decode refresh, the FA3 sm_margin/poison hooks,
    and whether the verdict was measured on a GPU or predicted from the sources (gpu_records)."""
    facts = load() if facts is None else facts
    sources = load(SOURCE_FILE) if sources is None else sources
    verdicts = {wheel_version(s["source"]): s["verdict"] for s in sources}
    names = list(BACKENDS)
    head = ["vLLM", "source check", "spec-decode layout", *(f"auditor {n}" for n in names)]
    head += ["in-graph refresh", "sm_margin / poison hooks", "on a GPU"]
    records = gpu_records()
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(facts, key=lambda r: version_key(r["version"])):
        cells = [r["version"], verdicts.get(r["version"], "not recorded"), _layout(r["layout"])]
        cells += [_auditor(r["backends"][n]) if n in r["backends"] else "not recorded" for n in names]
        cells += [_refresh(r), _fa3_hooks(r["fa3_hooks"]), measured(r["version"], records).split(" (")[0]]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m repro.vllm_integration.releases.versions")
    p.add_argument("wheels", nargs="+", help="vllm wheels (.whl) or checkout folders named like them")
    p.add_argument("--out", default=str(FACTS_FILE), help=f"where to write the record (default: {FACTS_FILE})")
    a = p.parse_args(argv)
    try:
        rows = record(a.wheels)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_whole(a.out, json.dumps(rows, indent=1) + "\n")  # a regular file or a new one
    print(f"written: {a.out} ({len(rows)} releases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
