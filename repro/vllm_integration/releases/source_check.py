"""Static check of a vLLM checkout: does the V2 runner's draft capture reuse the target's attention states? It reads
code patterns and runs nothing: it can name a known bad pattern, never vouch for a build (repro.vllm_integration.
releases.compat says what the answer rests on).

Before PR #48261 a speculator graph manager's `capture` took the target's saved states (`attn_states`, indexed by
the batch descriptor, `.warmup` / `.captured`: BAD_PATTERN); after it, every speculator manager builds dummy inputs and
metadata through `prepare_inputs_to_capture` for each pass (GOOD_PATTERN; the DFlash family's own
`_prepare_dflash_inputs_to_capture` in spec_decode/dflash/cudagraph.py, 0.34.0, is the same pattern). Every capture
manager of the V2 runner's spec-decode tree and capture utilities is read, each named with the pattern found or not
found; a manager with neither is listed as unrecognized. The V2 runner moved (spec_decode/eagle*,
spec_decode/autoregressive in 0.24-0.26, spec_decode/target_dependent_ar later); a tree without it is untestable."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from repro.contract.verdicts import SOURCE_BAD, SOURCE_GOOD, SOURCE_NO_KNOWN_BAD, SOURCE_UNTESTABLE
from repro.vllm_integration.plugin import SPEC_DIR, V2_DIR, spec_layout

GOOD, BAD, UNTESTABLE = SOURCE_GOOD, SOURCE_BAD, SOURCE_UNTESTABLE  # the words: repro.contract.verdicts
# the answer for sources with no known bad pattern that no GPU record of theirs vouches for (compat: vllm-check)
NO_KNOWN_BAD = SOURCE_NO_KNOWN_BAD
BAD_PATTERN = "reuses saved attention states (attn_states / .warmup / .captured)"
GOOD_PATTERN = "builds inputs and metadata for every pass (prepare_inputs_to_capture)"
PREPARE = re.compile(
    r"\b_?prepare\w*_inputs_to_capture\("
)  # prepare_inputs_to_capture, _prepare_dflash_inputs_to_capture


@dataclass
class SourceVerdict:
    verdict: str
    reason: str
    layout: str | None = None  # which V2 spec-decode layout the tree has
    evidence: list[str] = field(default_factory=list)


def _manager_files(root: Path) -> list[Path]:
    """Every file of the spec-decode tree, and the V2 runner's own capture utilities (the target's manager)."""
    v2 = root / V2_DIR
    return sorted({*(root / SPEC_DIR).rglob("*.py"), *v2.glob("cudagraph*.py"), *(v2 / "cudagraph").glob("*.py")})


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
        except (SyntaxError, UnicodeDecodeError):
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
    bad, good, other = [], [], []
    for path in _manager_files(root):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError) as e:
            return SourceVerdict(UNTESTABLE, f"{path.relative_to(root)}: does not parse ({e})", layout)
        for cls, fn in _capture_methods(tree):
            where = f"{path.relative_to(root)}:{fn.lineno} {cls}.capture"
            args = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
            body = ast.unparse(fn)
            if any("attn_state" in a for a in args) or ".captured" in body and ".warmup" in body:
                bad.append(f"{where} reuses saved attention states ({', '.join(a for a in args if 'attn' in a)})")
            elif m := PREPARE.search(body):
                good.append(f"{where} builds inputs and metadata for every pass ({m.group(0)[:-1]})")
            elif "create_forward_fn" in args:  # the capture loop itself: each pass's inputs are its caller's
                continue
            else:
                other.append(f"{where}: neither pattern found (unrecognized)")
    calls = _capture_calls(root)
    if bad and calls and not any(passes for _, passes in calls):
        # the reusing capture is dead code: every call site hands the managers something else (e.g. a local fix)
        good += [f"{b} (never called with saved states: {', '.join(w for w, _ in calls)})" for b in bad]
        bad = []
    if bad:
        reason = "draft capture reuses the target's attention metadata: " + bad[0]
        return SourceVerdict(BAD, reason, layout, bad + good + other)
    if good:
        rest = f"; {len(other)} capture manager(s) unrecognized" if other else ""
        return SourceVerdict(GOOD, f"{len(good)} capture manager(s) rebuild their metadata{rest}", layout, good + other)
    return SourceVerdict(UNTESTABLE, "no speculator CudaGraphManager.capture found", layout, other)
