"""The speculative methods a gate case runs (`--methods`, a case parameter like the mode and the backend): each one's
tiny target/draft pair, built by the harness (a config.json per model folder, the weights constructed after vLLM's
dummy loader: repro.vllm_integration.plugin.weights), its speculative_config, and whether a build has it at all.

  eagle        Llama target + EagleLlama draft (the gate's method since it began; its case ids carry no method)
  eagle3       the same Llama target + an Eagle3 Llama draft reading three of the target's hidden states
  draft_model  the same Llama target + a second, one-layer Llama as a standalone draft (its own KV cache and
               metadata: StandaloneARSpeculator in 0.34.0, the first release whose capture() records FULL graphs)
  mtp          a MiMo target (Qwen2 layers) with one multi-token-prediction layer; the draft is the target's own
               MTP layer (MTPSpeculator: a TargetDependentARSpeculator)
  dflash       the same Llama target + a two-layer DFlash draft (Qwen3 layers, non-causal, parallel drafting of a
               block from two of the target's hidden states and mask tokens; DFlashSpeculator, whose capture builds
               its own metadata: spec_decode/dflash/cudagraph.py). It agrees at block positions 1..4 (k <= 4; the
               gate runs 3): docs/dflash.md

Each pair agrees by construction (the `agree` weights: every model's head 0 reads the previous position's token,
its LM head maps it through one permutation; a draft fed one token ahead predicts what the target will), so the
reference's acceptance is asserted as it is for EAGLE (gate.judge.MIN_ACCEPTANCE).

Applicability is read from the build's own files (never a version list): the method must be one its V2 model
runner dispatches (speculator_config's method table, 0.27+; else init_speculator's branches, 0.24-0.26; a tree with
neither drafts with EAGLE only), and the speculator class it resolves to must have a capture() that does something
(BaseSpeculator.capture is `pass`: draft_model in 0.33.0 captured nothing). A method that is not applicable is a
skip that says why, never a clean case. The rest of the DFlash family (DFlash2, XPress, LiLiCorr under method
dflash with their own draft architectures; DSpark) shares dflash's capture path but has no agreeing pair here: each
is refused by name with its reason (NOT_HERE)."""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, replace
from pathlib import Path

from repro.errors import ConfigError
from repro.vllm_integration.gate import dynamic_k, sleep
from repro.vllm_integration.plugin.backend_fields import BACKENDS
from repro.vllm_integration.plugin.inject import STALE_REFRESH
from repro.vllm_integration.releases.builds import source_text
from repro.vllm_integration.releases.source_classes import assigned, imports, lookup, parse, strings

EAGLE, EAGLE3, DRAFT_MODEL, MTP = "eagle", "eagle3", "draft_model", "mtp"
DFLASH = "dflash"
METHODS = (EAGLE, EAGLE3, DRAFT_MODEL, MTP, DFLASH)
DEFAULT_METHOD = EAGLE  # a case without a method is an EAGLE case (records from before --methods)
# `--methods all`: every capture path the harness covers (EAGLE, EAGLE3 and MTP share one capture manager; the
# draft-model speculator and the DFlash family have their own), each not applicable where the build lacks it
ALL = (EAGLE, EAGLE3, DRAFT_MODEL, MTP, DFLASH)
# `gate --methods` when not given: every method, so the first command vouches for every capture path the build has
# (a mutant of one capture manager is caught by its own method alone); `--methods eagle` is the quick look
DEFAULT_METHODS = "all"
# the DFlash family beyond `dflash`: each captures through DFlashSpeculator.capture and its DFlashCudaGraphManager (the
# builder `dflash` exercises), each with a draft architecture the harness cannot yet make agree (docs/dflash.md)
_SAME_CAPTURE = "; its capture path (DFlashSpeculator.capture, spec_decode/dflash/cudagraph.py) is dflash's: use dflash"
NOT_HERE = {
    "dflash2": "runs as method dflash with a DFlash2DraftModel draft (grouped convolutions, a candidate selector): "
    "the harness has no agreeing DFlash2 draft" + _SAME_CAPTURE,
    "lilicorr": "runs as method dflash with a LiLiCorrDraftModel draft (DFlash2's candidate heads): "
    "the harness has no agreeing LiLiCorr draft" + _SAME_CAPTURE,
    "xpress": "runs as method dflash with a Qwen3XPressModel draft (a top-c candidate head): "
    "the harness has no agreeing XPress draft" + _SAME_CAPTURE,
    "dspark": "a DSpark draft (Qwen3DSparkModel: a Markov head, anchor sampling): the harness has no agreeing "
    "DSpark draft" + _SAME_CAPTURE,
}

TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_hidden_layers": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
DRAFT = {**TARGET, "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1}
# EAGLE3: the draft's fc reads the target's hidden states at layers 0 (its input), 1 and 2 (after each layer)
DRAFT_EAGLE3 = {
    **TARGET,
    "architectures": ["Eagle3LlamaForCausalLM"],
    "num_hidden_layers": 1,
    "draft_vocab_size": TARGET["vocab_size"],
    "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
}
DRAFT_LLAMA = {**TARGET, "num_hidden_layers": 1}  # draft_model: a standalone Llama sharing the vocabulary
# DFlash: a two-layer Qwen3 draft (model_type qwen3: no remote code; EAGLEConfig keeps DFlashDraftModel). Its fc reads
# the target's hidden states after layers 0 and 1 (DFlash's target_layer_ids: "after layer i", aux ids i + 1); its
# first MLP is a lookup table over the vocabulary (intermediate_size: the vocabulary and 2048 more); the mask token is
# the pad id 0; non-causal as DFlash checkpoints are (vLLM's default, said explicitly). weights.dflash_weights
DRAFT_DFLASH = {
    **TARGET,
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "num_hidden_layers": 2,
    "intermediate_size": TARGET["vocab_size"] + 2048,
    "attention_bias": False,
    "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0, 1], "causal": False},
}
# MTP: MiMo (Qwen2 layers, head_dim = hidden / heads = 128) with one MTP layer; model_type qwen2 so that no remote
# code is needed for its config (vLLM recognizes MiMo's MTP by the architecture name)
TARGET_MTP = {
    **{k: v for k, v in TARGET.items() if k != "head_dim"},
    "architectures": ["MiMoForCausalLM"],
    "model_type": "qwen2",
    "num_nextn_predict_layers": 1,
    "use_sliding_window": False,
    "max_window_layers": 2,
}


@dataclass(frozen=True)
class SpecMethod:
    name: str
    target: tuple[str, dict]  # (folder name, config)
    draft: tuple[str, dict] | None  # None: the draft is the target's own layers (MTP)
    # the draft picks its own attention backend unless the speculative_config names one: DFlash's loader builds the
    # draft with speculative_config.attention_backend, None choosing again (0.34.0 spec_decode/dflash/utils.py), where
    # the other drafts inherit the target's
    names_backend: bool = False
    base: str | None = None  # a dynamic-K method (gate.dynamic_k): the method it runs, with k_schedule
    k_schedule: tuple[tuple[int, int, int], ...] | None = None  # num_speculative_tokens_per_batch_size
    sleep_level: int | None = None  # a sleep-and-wake scenario (gate.sleep): the level, with base

    def models(self) -> tuple[tuple[str, dict], ...]:
        return (self.target,) + ((self.draft,) if self.draft else ())

    def speculative_config(self, draft: Path | None, spec_tokens: int, backend: str | None = None) -> dict:
        """LLM(speculative_config=...): the method, its draft model folder (none for MTP: the target's), k; the case's
        attention backend where the draft would not inherit it (names_backend)."""
        out = {"method": self.base or self.name, "num_speculative_tokens": spec_tokens}
        if self.k_schedule:
            out["num_speculative_tokens_per_batch_size"] = [list(e) for e in self.k_schedule]
        if draft is not None:
            out["model"] = str(draft)
        if self.names_backend and backend:
            out["attention_backend"] = backend
        return out


TABLE = {
    EAGLE: SpecMethod(EAGLE, ("target", TARGET), ("draft", DRAFT)),
    EAGLE3: SpecMethod(EAGLE3, ("target", TARGET), ("draft-eagle3", DRAFT_EAGLE3)),
    DRAFT_MODEL: SpecMethod(DRAFT_MODEL, ("target", TARGET), ("draft-llama", DRAFT_LLAMA)),
    MTP: SpecMethod(MTP, ("target-mtp", TARGET_MTP), None),
    DFLASH: SpecMethod(DFLASH, ("target", TARGET), ("draft-dflash", DRAFT_DFLASH), names_backend=True),
}
# each autoregressive method again with a K schedule per batch size (gate.dynamic_k): `--methods dynamic` names them all
DYNAMIC = tuple(dynamic_k.name_of(b) for b in dynamic_k.BASES)
TABLE.update(
    {dynamic_k.name_of(b): replace(TABLE[b], name=dynamic_k.name_of(b), base=b, k_schedule=dynamic_k.SCHEDULE)
     for b in dynamic_k.BASES}
)  # fmt: skip
NOT_HERE.update(dynamic_k.NOT_HERE)
# each method again with the engine put to sleep and woken before it generates (gate.sleep): `--methods sleep`
SLEEP = tuple(sleep.name_of(m, level) for m in METHODS for level in sleep.LEVELS)
TABLE.update(
    {sleep.name_of(m, lv): replace(TABLE[m], name=sleep.name_of(m, lv), base=m, sleep_level=lv)
     for m in METHODS for lv in sleep.LEVELS}
)  # fmt: skip


def parse_methods(text: str) -> tuple[str, ...]:
    """--methods: names of METHODS, or `all` (ALL), comma-separated, each at most once."""
    names = [x.strip().lower() for x in text.split(",") if x.strip()]
    out: list[str] = []
    for n in names:
        for m in {"all": ALL, "dynamic": DYNAMIC, "sleep": SLEEP}.get(n, (n,)):
            if m in NOT_HERE:
                raise ConfigError(f"--methods {m}: {NOT_HERE[m]}")
            if m not in TABLE:
                raise ConfigError(
                    f"--methods {m!r}: use {', '.join((*METHODS, *DYNAMIC, *SLEEP))}, all, dynamic or sleep"
                )
            if m in out:
                raise ConfigError(f"--methods: {m} given twice (one case id each; use --repeat to run again)")
            out.append(m)
    if not out:
        raise ConfigError("no speculative method given")
    return tuple(out)


def add_option(parser: argparse.ArgumentParser) -> None:
    """`gate --methods` (parsed: a tuple of method names; a bad value is argparse's usage error, with the reason) and
    `--self-control-forms` (the injection forms every method's self control runs in; a dynamic-K method adds its own)."""
    from repro.vllm_integration.plugin.inject import ALL_INJECTIONS, INJECTIONS  # the forms: only for the option

    def forms(text: str) -> tuple[str, ...]:
        out = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
        if not out or any(f not in ALL_INJECTIONS for f in out):
            raise argparse.ArgumentTypeError(f"{text!r}: use some of {', '.join(ALL_INJECTIONS)}")
        return out

    parser.add_argument(
        "--self-control-forms",
        dest="forms",
        type=forms,
        default=INJECTIONS,
        help="the self control's injection forms, comma-separated (stale-refresh: every draft-decode refresh for a "
        "step far ahead, a build with update_draft_decode_metadata only) (default %(default)s)",
    )

    def methods(text: str) -> tuple[str, ...]:
        try:
            return parse_methods(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parser.add_argument(
        "--methods",
        type=methods,
        default=DEFAULT_METHODS,
        help=f"speculative methods, each a case parameter with its own model pair, reference and self control: "
        f"{', '.join(METHODS)}, or all ({', '.join(ALL)}: the methods measured on a GPU); with a K schedule per "
        f"batch size: {', '.join(DYNAMIC)}, or dynamic (all four); slept and woken before generating: "
        "<method>_sleep1 and _sleep2, or sleep (every method at both levels) (a method "
        "the build lacks, or captures no FULL draft graph for, is not applicable there; --compare-paths runs eagle) "
        "(default %(default)s)",
    )


SPEC = Path("v1") / "worker" / "gpu" / "spec_decode"


def _capture_body(node: ast.ClassDef) -> list[ast.stmt] | None:
    for n in node.body:
        if isinstance(n, ast.FunctionDef) and n.name == "capture":
            return [s for s in n.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return None


def _noop(body: list[ast.stmt]) -> bool:
    """A capture() that records nothing: only pass, `...`, a bare return or a log line."""
    for s in body:
        if isinstance(s, ast.Pass) or isinstance(s, ast.Return) and s.value is None:
            continue
        if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and "logger" in ast.unparse(s.value.func):
            continue
        return False
    return True


# init_speculator's branches that name no method: the SpeculativeConfig predicate each method answers true to
PREDICATES = {EAGLE: "use_eagle()", EAGLE3: "use_eagle()", DRAFT_MODEL: "uses_draft_model()", DFLASH: "use_dflash()"}


def _speculator_of(package_dir: Path, method: str) -> tuple[str | None, str]:
    """(the speculator class's qualified name or None, where it was read / why none)."""
    spec = package_dir / SPEC
    table = parse(spec / "speculator_config.py")
    if table is not None:  # 0.27+: a method table of config classes, each naming its speculator class
        for n in ast.walk(table):
            if isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == EAGLE for k in n.keys):
                entries = {k.value: v for k, v in zip(n.keys, n.values) if isinstance(k, ast.Constant)}
                if method not in entries:
                    return None, f"not a speculative method of this build (its methods: {', '.join(sorted(entries))})"
                parts = strings(entries[method])
                cfg_module, cfg_cls = f"vllm.v1.worker.gpu.spec_decode.{parts[0]}", parts[-1]
                qual = lookup(package_dir, cfg_module, cfg_cls, lambda c: assigned(c, "speculator_class"))
                if not qual or qual == "None":
                    return None, f"{cfg_cls} names no V2 speculator class"
                return qual, "speculator_config"
    init = parse(spec / "__init__.py")
    fn = (
        next((n for n in ast.walk(init) if isinstance(n, ast.FunctionDef) and n.name == "init_speculator"), None)
        if init
        else None
    )
    if fn is None:  # 0.20-0.23: no dispatch, the V2 runner drafts with EAGLE
        if method == EAGLE:
            return "", "no method dispatch (EAGLE only)"
        return None, "this build's V2 runner has no method dispatch (init_speculator / speculator_config): EAGLE only"
    for n in ast.walk(fn):
        if not isinstance(n, ast.If):
            continue
        test = ast.unparse(n.test)
        if f"'{method}'" in test or f'"{method}"' in test or PREDICATES.get(method, "?") in test:
            branch = ast.Module(body=n.body, type_ignores=[])  # its imports, a relative one read from spec_decode/
            imported = [(m, a) for m, a in imports(branch, "vllm.v1.worker.gpu.spec_decode", True).values() if a]
            if imported:
                return f"{imported[0][0]}.{imported[0][1]}", "init_speculator"
    return None, f"init_speculator of this build has no branch for method {method!r}"


def vllm_method(method: str) -> str:
    """The method vLLM is configured with for a gate method (SpecMethod.speculative_config): a scenario's base."""
    return (TABLE[method].base or method) if method in TABLE else method


def speculator_class(package_dir: Path | None, method: str) -> str | None:
    """The class name of the speculator this build's files resolve `method` to (None: its files do not say)."""
    if package_dir is None or not (package_dir / SPEC).is_dir():
        return None
    qual, _ = _speculator_of(package_dir, method)
    return qual.rpartition(".")[2] or None if qual else None


def not_applicable(package_dir: Path | None, method: str) -> str | None:
    """Why this build cannot run `method` with FULL draft graphs (None: it can, or its files cannot tell); a
    dynamic-K method: its base method's answer, then whether the build specializes its graphs by K."""
    if package_dir is None or not (package_dir / SPEC).is_dir():
        return None
    if level := sleep.level_of(method):
        base = method[: -len(f"{sleep.SUFFIX}{level}")]
        return not_applicable(package_dir, base) or sleep.not_supported(package_dir, level)
    if base := dynamic_k.base_of(method):
        if why := not_applicable(package_dir, base):
            return why
        qual, _ = _speculator_of(package_dir, base)
        module, _, cls = (qual or "").rpartition(".")
        is_ar = bool(cls) and lookup(package_dir, module, cls, lambda c: c.name == dynamic_k.AR_BASE or None)
        return dynamic_k.not_supported(package_dir, cls or None, bool(is_ar))
    qual, where = _speculator_of(package_dir, method)
    if qual is None:
        return f"method {method}: {where}"
    if not qual:
        return None
    module, _, cls = qual.rpartition(".")
    body = lookup(package_dir, module, cls, _capture_body)
    if body is None:
        return f"method {method}: its speculator {cls} ({where}) has no capture()"
    if _noop(body):
        return f"method {method}: its speculator {cls}'s capture() records nothing (no FULL draft graph)"
    return None


def form_not_applicable(package_dir: Path | None, inject: str | None, backend: str) -> str | None:
    """Why a self-control form cannot re-create its defect in this build (None: it can, or its files cannot tell):
    stale-refresh needs the backend's draft-decode refresh (its builder's update_draft_decode_metadata)."""
    known = BACKENDS.get(backend)
    if inject != STALE_REFRESH or package_dir is None or known is None:
        return None
    path = package_dir.joinpath(*known.module.split(".")[1:]).with_suffix(".py")
    if not path.exists():
        return None
    if "def update_draft_decode_metadata" not in source_text(path):
        return f"self-control form {STALE_REFRESH}: this build's {backend} builder has no update_draft_decode_metadata"
    return None
