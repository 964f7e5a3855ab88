"""What a report quotes of a process's output: the error's own whole line, never a cut in the middle of a word.

A case's output ends with the traceback's last lines, CUDA's advice ("CUDA kernel errors might be asynchronously
reported at some other API call ...", "For debugging consider passing CUDA_LAUNCH_BLOCKING=1") and links; the line a
person needs is the error itself (`torch.AcceleratorError: CUDA error: device-side assert triggered`, a device
assert's `Assertion ... failed.`). `error_line` picks it; `shorten` cuts any text at a word boundary."""

from __future__ import annotations

import re

# a line that states an error: an exception's name and message, CUDA's error line, a device assertion
_ERROR = re.compile(r"\b\w*(Error|Exception)\b:|CUDA error|error:|Assertion .* failed|device-side assert", re.I)
_ADVICE = re.compile(r"asynchronously reported|CUDA_LAUNCH_BLOCKING|TORCH_USE_CUDA_DSA|https?://|^\s*(File|\^)")


def shorten(text: str, limit: int = 300) -> str:
    """`text` whole when it fits, else cut at the last space before `limit`, marked with an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "…"


def error_line(output: str, limit: int = 300) -> str:
    """The last line of `output` that states an error and is no advice (whole, shortened only past `limit` at a
    word); else its last lines that fit in `limit`, each whole."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _ERROR.search(ln) and not _ADVICE.search(ln):
            return shorten(ln, limit)
    kept: list[str] = []
    for ln in reversed(lines):
        if kept and sum(len(k) + 3 for k in kept) + len(ln) > limit:
            break
        kept.insert(0, ln)
    return shorten(" / ".join(kept), limit)
