"""Static check of a vLLM checkout: does the V2 runner's draft capture reuse the target's attention states?

Before PR #48261 a speculator graph manager's `capture` took the target's saved states (`attn_states`, indexed by
the batch descriptor, `.warmup` / `.captured`); after it, every speculator manager builds dummy inputs and metadata
through `prepare_inputs_to_capture` for each pass. The V2 runner moved (spec_decode/eagle*, spec_decode/autoregressive
in 0.24-0.26, spec_decode/target_dependent_ar later); a tree without it is reported as untestable."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from repro.judge.verdicts import SOURCE_BAD, SOURCE_GOOD, SOURCE_UNTESTABLE

GOOD, BAD, UNTESTABLE = SOURCE_GOOD, SOURCE_BAD, SOURCE_UNTESTABLE  # the words: repro.judge.verdicts
V2_DIR = "vllm/v1/worker/gpu"
SPEC_DIR = f"{V2_DIR}/spec_decode"


@dataclass
class SourceVerdict:
    verdict: str
    reason: str
    layout: str | None = None  # which V2 spec-decode layout the tree has
    evidence: list[str] = field(default_factory=list)


def spec_layout(root: Path) -> str | None:
    spec = root / SPEC_DIR
    for name in ("target_dependent_ar", "autoregressive", "eagle"):
        if (spec / name).is_dir():
            return name
    if (spec / "eagle_cudagraph.py").exists() or (spec / "eagle.py").exists():
        return "eagle-module"
    return None


def _manager_files(root: Path) -> list[Path]:
    spec = root / SPEC_DIR
    return sorted(p for p in spec.rglob("*.py") if "cudagraph" in p.name or p.parent == spec and p.name == "eagle.py")


def _capture_methods(tree: ast.AST):
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if "CudaGraphManager" not in cls.name and not any("CudaGraphManager" in ast.unparse(b) for b in cls.bases):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "capture":
                yield cls.name, fn


def _capture_calls(root: Path) -> list[tuple[str, bool]]:
    """Every `<manager>.capture(...)` call in the spec-decode tree: (where, does it pass saved attention states)."""
    out = []
    for path in sorted((root / SPEC_DIR).rglob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "capture":
                if ast.unparse(node.func.value) == "super()":
                    continue
                args = [ast.unparse(a) for a in node.args] + [ast.unparse(k.value) for k in node.keywords]
                out.append((f"{path.relative_to(root)}:{node.lineno}", any("attn_state" in a for a in args)))
    return out


def check_tree(root: str | Path) -> SourceVerdict:
    root = Path(root)
    if not (root / "vllm").is_dir():
        hint = (
            f": this is the vllm package itself; name the folder that holds it ({root.parent})"
            if root.name == "vllm" and (root / "__init__.py").exists()
            else ""
        )
        return SourceVerdict(UNTESTABLE, f"{root}: not a vLLM checkout (no vllm/ package){hint}")
    if not (root / V2_DIR).is_dir():
        return SourceVerdict(UNTESTABLE, "no V2 model runner (vllm/v1/worker/gpu) in this tree")
    layout = spec_layout(root)
    if layout is None:
        return SourceVerdict(UNTESTABLE, "V2 runner has no speculative-decoding capture code in a known layout")
    bad, good = [], []
    for path in _manager_files(root):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError as e:
            return SourceVerdict(UNTESTABLE, f"{path.relative_to(root)}: does not parse ({e})", layout)
        for cls, fn in _capture_methods(tree):
            where = f"{path.relative_to(root)}:{fn.lineno} {cls}.capture"
            args = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
            body = ast.unparse(fn)
            if any("attn_state" in a for a in args) or ".captured" in body and ".warmup" in body:
                bad.append(f"{where} reuses saved attention states ({', '.join(a for a in args if 'attn' in a)})")
            elif "prepare_inputs_to_capture" in body:
                good.append(f"{where} builds inputs and metadata for every pass")
    calls = _capture_calls(root)
    if bad and calls and not any(passes for _, passes in calls):
        # the reusing capture is dead code: every call site hands the managers something else (e.g. a local fix)
        good += [f"{b} (never called with saved states: {', '.join(w for w, _ in calls)})" for b in bad]
        bad = []
    if bad:
        return SourceVerdict(BAD, "draft capture reuses the target's attention metadata: " + bad[0], layout, bad + good)
    if good:
        return SourceVerdict(GOOD, "every speculator capture rebuilds its metadata", layout, good)
    return SourceVerdict(UNTESTABLE, "no speculator CudaGraphManager.capture found", layout)
