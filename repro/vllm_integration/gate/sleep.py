"""Sleep and wake as a gate scenario: each method again as `<method>_sleep1` and `<method>_sleep2` (case ids
`eagle-sleep1`), whose case builds the engine (its CUDA graphs captured), puts it to sleep (`LLM.sleep(level)`),
wakes it (`LLM.wake_up()`) and only then generates, so every graph replayed was captured before the sleep: the
family of vLLM #55013 (EAGLE3, sleep level 2 and CUDA graphs: an illegal memory access when the draft's multi-step
graph replays after wake_up), buffers freed and re-made under captured graphs. Judged like any case, in audit and in
plain, its acceptance against its reference's (the reference never sleeps).

Level 1 offloads the weights and discards the KV cache; level 2 discards the parameters and offloads the rest of the
model's GPU state. The gate's weights are constructed in the engine (repro.vllm_integration.plugin.weights) and no
checkpoint could reload them, so level 2 keeps every parameter (`sleep_preserve_parameter_names`, target's and
draft's) and discards everything else: a build without that option cannot run level 2 comparably and it is not
applicable there, with the reason. In vLLM 0.34.0 (cumem backend) both levels back up the weights, the runtime's
buffers and the CUDA graphs' memory and restore them at the same addresses; the KV cache and workspace scratch are
never restored; level 2 differs only in the parameters it may discard, none here, so the two levels differ in vLLM's
code path (its level-2 discard set) rather than in what is restored. A build without sleep mode (no enable_sleep_mode, LLM.sleep or LLM.wake_up):
not applicable, with the reason. That the case slept and woke is counted (`slept`, the level; coverage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from repro.vllm_integration.releases.builds import source_text

SUFFIX = "_sleep"
LEVELS = (1, 2)
KEEP_EVERY_PARAMETER = ["*", "draft.*"]  # vLLM's globs: the target's parameters and the draft's own


def name_of(base: str, level: int) -> str:
    return f"{base}{SUFFIX}{level}"


def level_of(method: str) -> int | None:
    """The sleep level a method's name asks for (None: not a sleep scenario)."""
    head, sep, tail = method.rpartition(SUFFIX)
    return int(tail) if sep and head and tail.isdigit() and int(tail) in LEVELS else None


def engine_kwargs(level: int | None, reference: bool) -> dict[str, Any]:
    """What LLM(...) needs for the scenario (nothing for a reference, which never sleeps)."""
    if not level or reference:
        return {}
    out: dict[str, Any] = {"enable_sleep_mode": True}
    if level == 2:
        out["sleep_preserve_parameter_names"] = list(KEEP_EVERY_PARAMETER)
    return out


def sleep_and_wake(llm: Any, level: int | None, reference: bool, counters: dict[str, Any]) -> None:
    """The scenario between the engine's start and its generate: sleep at `level`, wake every allocation; counted
    in counters['slept'] (the level) once it woke. Nothing for a reference or a case without the scenario."""
    if not level or reference:
        return
    llm.sleep(level=level)
    llm.wake_up()
    counters["slept"] = level


def not_supported(package_dir: Path, level: int) -> str | None:
    """Why this build cannot run the scenario at `level` (None: it can), read from its files."""
    model = source_text(package_dir / "config" / "model.py")
    entry = source_text(package_dir / "entrypoints" / "llm.py")
    if "enable_sleep_mode" not in model or "def sleep(" not in entry or "def wake_up(" not in entry:
        return "sleep mode: this build has no enable_sleep_mode with LLM.sleep and LLM.wake_up"
    if level == 2 and "sleep_preserve_parameter_names" not in model:
        return (
            "sleep level 2: this build cannot keep the parameters across it (no sleep_preserve_parameter_names), "
            "and the gate's constructed weights cannot be loaded again: its output would not be comparable"
        )
    return None
