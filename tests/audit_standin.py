"""A person's vLLM program, over the stand-in vLLM of tests/fake_vllm.py (its LLM loads the general plugins through
their entry points, so the real plugin audits it), in each process layout vLLM users run (not collected: no test_
prefix). `python tests/audit_standin.py LAYOUT [METHOD] [EXIT]`:

  inproc      the engine in the script's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
  fork        vLLM's multi-process engine as a library: a front-end that loads the plugin and checks nothing, the
              engine core forked by multiprocessing (it ends through os._exit: multiprocessing's finalizers report)
  spawn       the same, the engine core spawned
  twice       `LLM` used twice in one script: two engine cores, one after the other
  serve       `vllm serve`: the front-end, the engine core a process of its own (not multiprocessing's), its
              requests from a bounded driver
  dp:N        data/tensor parallel: N engine processes at once
  die         the engine core is killed (SIGKILL) after its captures and requests, before its exit report (as
              `vllm serve`'s shutdown force-kills its engine core): it leaves its last snapshot
  die-early   an engine process is killed (SIGKILL) as soon as it loaded the plugin: no report at all
EXIT: the script's own exit status (default 0)."""

import multiprocessing
import os
import signal
import subprocess
import sys

LAYOUT = sys.argv[1]
METHOD = sys.argv[2] if len(sys.argv) > 2 else "eagle"
EXIT = int(sys.argv[3]) if len(sys.argv) > 3 else 0


def front_end() -> None:
    """What vLLM's front-end process does with the plugins: loads them, runs no model."""
    import importlib.metadata

    for ep in importlib.metadata.entry_points(group="vllm.general_plugins"):
        ep.load()()


def engine(method: str = METHOD) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model="tiny",
        speculative_config={"method": method, "num_speculative_tokens": 3},
        compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"},
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))


def killed() -> None:
    engine()
    os.kill(os.getpid(), signal.SIGKILL)


def killed_early() -> None:
    front_end()  # a spawned process loads the plugin anew: the auditor installs and leaves its start mark
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    if LAYOUT == "inproc":
        engine()
    elif LAYOUT in ("fork", "spawn", "twice", "die", "die-early") or LAYOUT.startswith("dp:"):
        front_end()
        ctx = multiprocessing.get_context("spawn" if LAYOUT in ("spawn", "die-early") else "fork")
        n = int(LAYOUT.split(":")[1]) if LAYOUT.startswith("dp:") else 1
        rounds = 2 if LAYOUT == "twice" else 1
        target = {"die": killed, "die-early": killed_early}.get(LAYOUT, engine)
        for _ in range(rounds):
            procs = [ctx.Process(target=target, name="EngineCore") for _ in range(n)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
    elif LAYOUT == "serve":
        front_end()
        core = subprocess.Popen([sys.executable, __file__, "inproc", METHOD])
        core.wait(timeout=120)  # the bounded driver: the server's one engine, waited for
    else:
        raise SystemExit(f"unknown layout {LAYOUT}")
    sys.exit(EXIT)
