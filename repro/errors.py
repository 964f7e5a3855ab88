"""Every exception the harness raises on purpose, in one module, and what each becomes where it ends a command
(the exit codes themselves: repro.exit_codes).

| exception | raised when | where it ends |
|---|---|---|
| ConfigError | bad user input | repro.cli.main: one line on stderr, exit 2 |
| Unavailable | this machine cannot provide a configuration (no GPU, MPS, MIG...) | a case skips with the message; `run`: exit 4 |
| BackendUnavailable | an FA3 backend's kernels cannot be loaded here | the case process reports a skip with the message |
| AbiMismatch | an overlay's Python sources and compiled parts were built for different torch releases | a bisect step: untestable (125) |
| ForkUnavailable | a build's forkserver cannot take a case (refused, gone, not ready) | the case is spawned plainly, its phases say why |
| ForkServerDied | a build's forkserver died while a case ran | the case runs again, spawned plainly, and the run's notes say so |
| ProtocolError | a line on a forkserver's pipes is not a record of its schema | the gate: that forkserver is killed, its cases spawned plainly |
| BadRequest | a gate case's request (repro.contract.request) has a key unknown or missing, or a value of another type | the case process: its traceback and exit 1 (an ERROR naming the key); the plugin: an error record |
| StaleCapture | `repro audit --strict`: the first FULL capture that baked in stale metadata (repro.vllm_integration.plugin.capture) | inside vLLM: the engine process ends, its report written first; `repro audit` judges the report (AFFECTED, 1) |
| MissingKey | a live channel record lacks a key its writer always writes, and no replay's upgrader marked it as older (repro.contract.channel.has) | the gate's judging: the case cannot vouch, a reference is not trusted (an error), the reason naming the key |

This module imports nothing: every layer (the plugin inside vLLM and the forkserver included) can import it."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input: the CLI turns it into a one-line error and exit code 2."""


class Unavailable(RuntimeError):
    """This machine cannot provide the configuration; the message is the skip reason."""


class BackendUnavailable(RuntimeError):
    """The backend's kernels cannot be loaded here; the message says why and how to fix it."""


class AbiMismatch(FileNotFoundError):
    """The Python sources and the compiled parts of an overlay were built for different torch releases."""


class ForkUnavailable(Exception):
    """The forkserver cannot take this case (it refused, is gone or not ready): nothing was started."""


class ForkServerDied(Exception):
    """The forkserver died while the case ran; the case's process group was killed."""


class Stopped(RuntimeError):
    """The run is being stopped (Ctrl-C, SIGTERM, an error): no further case process starts."""


class ProtocolError(ValueError):
    """A line that is not a record of this schema."""


class BadRequest(ProtocolError):
    """A case request that is not one of its schema: the key unknown, missing or of another type is named."""


class MissingKey(ProtocolError):
    """A live record without a key its writer always writes (never read as if it had said the harmless value)."""


class StaleCapture(RuntimeError):
    """`repro audit --strict`: a FULL capture baked in stale attention metadata; raised inside vLLM to end the run."""
