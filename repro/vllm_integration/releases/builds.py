"""The vLLM builds a gate run tests, found without importing vLLM.

- the installed `vllm` (whatever `import vllm` finds in this environment), under test;
- REPRO_VLLM=LABEL=PREFIX[,LABEL=PREFIX...]: more builds under test, each a folder holding a `vllm` package (a
  site-packages folder, an unpacked bundle, an overlay made by `repro.vllm_integration.releases.bisect`);
- REPRO_VLLM_CONTROL=LABEL=PREFIX[,...]: known-bad controls (e.g. 0.25.1), which the gate must catch.

Builds under test must come back clean; a control that comes back clean makes the run HARNESS BLIND."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from repro.errors import ConfigError
from repro.vllm_integration.releases.bisect import (  # bisect's overlay, shared: one home for it
    abi_problem,
    build_overlay,
)

UNDER_TEST, CONTROL = "under-test", "control"
BUILDS_ENV, CONTROL_ENV = "REPRO_VLLM", "REPRO_VLLM_CONTROL"
_LABEL = re.compile(r"^(?!\.+$)[A-Za-z0-9._+-]+$")  # dots alone (".", "..") would name a folder above its own


def check_label(label: str, flag: str) -> str:
    """A build's label: it names the build's case ids, log files and overlay folder, so never a path of its own."""
    if not _LABEL.match(label):
        raise ConfigError(f"{flag}: label {label!r} may hold letters, digits and . _ + - only (not dots alone)")
    return label


@dataclass(frozen=True)
class VllmBuild:
    label: str  # what the case id shows: the version, or the name given in the environment
    prefix: str | None  # folder to put first on PYTHONPATH; None: the installed vllm
    role: str = UNDER_TEST
    version: str | None = None  # read from the build's own files
    # a torch of its own (--torch LABEL=PREFIX): a release that pins another torch than the one installed runs with
    # this folder before its prefix on PYTHONPATH
    torch_prefix: str | None = None

    @property
    def package_dir(self) -> Path | None:
        if self.prefix is not None:
            return Path(self.prefix) / "vllm"
        spec = importlib.util.find_spec("vllm")
        return Path(spec.origin).parent if spec and spec.origin else None

    def to_dict(self) -> dict:
        d = {"label": self.label, "prefix": self.prefix, "role": self.role, "version": self.version}
        if self.torch_prefix:
            d["torch_prefix"] = self.torch_prefix
        return d

    @property
    def torch_version(self) -> str | None:
        """The release of the build's own torch (--torch), None when it runs with the installed one."""
        return read_torch_version(self.torch_prefix) if self.torch_prefix else None


def read_torch_version(prefix: str | Path) -> str | None:
    """The version a prefix's torch declares: its dist-info, else torch/version.py."""
    return _declared_version(prefix, "torch", "version.py")


def attach_torch(builds: list[VllmBuild], text: str, variable: str = "--torch") -> list[VllmBuild]:
    """LABEL=PREFIX[,LABEL=PREFIX...]: the named builds get a torch of their own (a folder holding torch/)."""
    by_label = {b.label: b for b in builds}
    given: dict[str, str] = {}
    for label, prefix in _label_prefixes(text, variable, "0.33.0=/opt/torch-2.14"):
        if label not in by_label:
            raise ConfigError(f"{variable}: no build is labelled {label!r} (builds: {', '.join(by_label) or 'none'})")
        if label in given:
            raise ConfigError(f"{variable}: build {label!r} given a torch twice")
        if not (Path(prefix) / "torch" / "__init__.py").exists():
            raise ConfigError(f"{variable}: {prefix} holds no torch package ({prefix}/torch/__init__.py missing)")
        given[label] = str(Path(prefix).resolve())
    return [replace(b, torch_prefix=given[b.label]) if b.label in given else b for b in builds]


def read_version(prefix: str | Path) -> str | None:
    """The version a prefix's vllm package declares: its dist-info, else vllm/_version.py."""
    return _declared_version(prefix, "vllm", "_version.py")


def _declared_version(prefix: str | Path, package: str, version_file: str) -> str | None:
    """The version a prefix declares for a package: its PACKAGE-*.dist-info METADATA, else PACKAGE/VERSION_FILE."""
    prefix = Path(prefix)
    for dist in sorted(prefix.glob(f"{package}-*.dist-info")):
        meta = dist / "METADATA"
        if meta.exists():
            m = re.search(r"^Version: (\S+)", meta.read_text(errors="replace"), re.M)
            if m:
                return m[1]
    ver = prefix / package / version_file
    if ver.exists():
        m = re.search(r"""(?:__version__|version)\s*(?::\s*str)?\s*=\s*['"]([^'"]+)['"]""", ver.read_text())
        if m:
            return m[1]
    return None


def _label_prefixes(text: str, variable: str, example: str) -> list[tuple[str, str]]:
    """The (LABEL, PREFIX) pairs of a LABEL=PREFIX[,LABEL=PREFIX...] option (empty items skipped), ConfigError for an
    item of another form. A new item starts at a comma followed by LABEL=, so a folder's name may hold a comma."""
    out = []
    for item in (x.strip() for x in re.split(r",(?=[\w.+-]+=)", text)):  # a comma inside a PREFIX stays in it
        if not item:
            continue
        label, sep, prefix = item.partition("=")
        if not sep or not label or not prefix:
            raise ConfigError(f"{variable}: {item!r} is not LABEL=PREFIX (e.g. {example})")
        out.append((label, prefix))
    return out


def parse_builds(text: str, role: str, variable: str) -> list[VllmBuild]:
    """LABEL=PREFIX[,LABEL=PREFIX...]; every prefix must hold a vllm package."""
    out = []
    for label, prefix in _label_prefixes(text, variable, "0.25.1=/opt/vllm-0.25.1"):
        check_label(label, variable)
        if not (Path(prefix) / "vllm" / "__init__.py").exists():
            hint = (
                ": a wheel runs installed, e.g. `python -m pip install --no-deps --target DIR WHEEL`, then LABEL=DIR"
                if str(prefix).endswith(".whl")
                else ": name the folder that holds vllm/ (site-packages or a --target folder), not vllm/ itself"
                if Path(prefix).name == "vllm"
                else ""
            )
            raise ConfigError(f"{variable}: {prefix} holds no vllm package ({prefix}/vllm/__init__.py missing){hint}")
        out.append(VllmBuild(label, str(Path(prefix).resolve()), role, read_version(prefix)))
    return out


def installed_build() -> VllmBuild | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return VllmBuild(version or "installed", None, UNDER_TEST, version)


def find_builds(environ: dict[str, str] | None = None, include_installed: bool = True) -> list[VllmBuild]:
    env = os.environ if environ is None else environ
    named = parse_builds(env.get(BUILDS_ENV, ""), UNDER_TEST, BUILDS_ENV)
    named += parse_builds(env.get(CONTROL_ENV, ""), CONTROL, CONTROL_ENV)
    inst = installed_build() if include_installed else None
    pkg = inst.package_dir if inst is not None else None
    if pkg is not None and str(pkg.parent.resolve()) in {b.prefix for b in named}:
        inst = None  # the "installed" vllm is one of the named prefixes, already on PYTHONPATH
    builds = ([inst] if inst else []) + named
    labels = [(b.label, b.role) for b in builds]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise ConfigError(f"two vLLM builds share the label {sorted(dup)[0][0]!r}: give them distinct labels")
    return builds


def build_pythonpath(build: VllmBuild, all_builds: list[VllmBuild], current: str | None) -> str:
    """PYTHONPATH for a case of `build`: its own torch (if it has one) and its prefix first, every other build's prefix
    and torch removed (never two vLLMs, never another build's torch)."""
    own = [p for p in (build.torch_prefix, build.prefix) if p]
    others = {p for b in all_builds for p in (b.prefix, b.torch_prefix) if p and p not in own}
    parts = [p for p in (current or "").split(os.pathsep) if p and str(Path(p).resolve()) not in others]
    return os.pathsep.join(own + [p for p in parts if str(Path(p).resolve()) not in own])


SITE_DIRS_ENV = "REPRO_SITE_DIRS"  # a case's build prefixes, processed as site folders in its process (add_site_dirs)


def site_dirs(build: VllmBuild) -> str:
    """The folders of a build that its case process adds as site folders (its torch's, then its own prefix): a
    prefix is often a site-packages folder whose .pth files put modules on sys.path (nvidia-cutlass-dsl's), which
    PYTHONPATH alone never processes."""
    return os.pathsep.join(p for p in (build.torch_prefix, build.prefix) if p)


def add_site_dirs(environ: dict[str, str] | None = None) -> list[str]:
    """In a case process, before torch or vLLM is imported: site.addsitedir for every folder SITE_DIRS_ENV names, so
    their .pth files take effect as in that environment (the folders stay where PYTHONPATH put them). Returns the
    folders added."""
    import site  # only in a case process (and the CPU tests): the parent never adds site folders

    env = os.environ if environ is None else environ
    dirs = [d for d in env.get(SITE_DIRS_ENV, "").split(os.pathsep) if d and os.path.isdir(d)]
    for d in dirs:
        if d not in _SITES_ADDED:  # once per process (a case forked from its forkserver inherits the forkserver's)
            site.addsitedir(d)
            _SITES_ADDED.add(d)
    return dirs


_SITES_ADDED: set[str] = set()


@dataclass(frozen=True)
class Overlay:
    """--overlay LABEL=SOURCES@BASE, judged (check_overlay) and not made yet: one release's Python sources over
    another build's compiled parts. `sources` holds a vllm/ package (a checkout, or a wheel's files without its .so,
    with its vllm-*.dist-info when it has one), `base` a build prefix (vllm/ with its compiled extensions, and the
    packages it needs beside it)."""

    label: str
    sources: Path
    base: Path

    def listed(self) -> VllmBuild:
        """The build as a dry run lists it: nothing made, so no prefix yet."""
        return VllmBuild(self.label, None, UNDER_TEST, read_version(self.sources))

    def make(self, dest_root: str | Path) -> VllmBuild:
        """The build at dest_root/label: vllm/ = the sources plus base's .so files
        (repro.vllm_integration.releases.bisect.build_overlay), every other entry of base linked (its dependencies), and the
        sources' dist-info."""
        dest = Path(dest_root) / self.label
        if dest.exists():
            shutil.rmtree(dest)
        build_overlay(self.sources, self.base / "vllm", dest)
        for entry in self.base.iterdir():
            if entry.name == "vllm" or entry.name.startswith("vllm-") and entry.name.endswith(".dist-info"):
                continue
            (dest / entry.name).symlink_to(entry.resolve())
        infos = sorted(self.sources.glob("vllm-*.dist-info"))
        for info in infos:
            shutil.copytree(info, dest / info.name)
        if not infos:  # a checkout, or a wheel's vllm/ alone: vLLM's platform detection reads the package metadata
            write_dist_info(dest, read_version(self.sources) or "0+overlay")
        return VllmBuild(self.label, str(dest.resolve()), UNDER_TEST, read_version(dest))


def write_dist_info(prefix: Path, version: str) -> Path:
    """A vllm-VERSION.dist-info with the metadata importlib.metadata reads. Without one, version("vllm") raises in
    vLLM's CUDA platform check, which then finds no platform: every case dies with "Device string must not be empty"
    (results/h200-release-sweep-fast, 0.24.0 and 0.25.0 as a wheel's vllm/ without its dist-info)."""
    info = prefix / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return info


def check_overlay(label: str, sources: str | Path, base: str | Path) -> Overlay:
    """Every reason an overlay cannot be made, as ConfigError, before anything is written: a bad label, a side without
    its vllm package, torch pins or required extension modules that differ (bisect.abi_problem), a base without
    compiled extensions."""
    check_label(label, "--overlay")
    src, base = Path(sources), Path(base)
    if not (src / "vllm" / "__init__.py").exists():
        raise ConfigError(f"--overlay {label}: {src} holds no vllm/ package of sources")
    if not (base / "vllm" / "__init__.py").exists():
        raise ConfigError(f"--overlay {label}: {base} holds no vllm package to take the compiled parts from")
    if why := abi_problem(src, base / "vllm"):
        raise ConfigError(f"--overlay: {why}")
    if next((base / "vllm").rglob("*.so"), None) is None:
        raise ConfigError(f"--overlay {label}: {base}/vllm has no compiled extensions to overlay")
    return Overlay(label, src, base)


def overlay_build(label: str, sources: str | Path, base: str | Path, dest_root: str | Path) -> VllmBuild:
    """The overlay build made at dest_root/label (check_overlay, then Overlay.make)."""
    return check_overlay(label, sources, base).make(dest_root)


def make_overlays(
    overlays: list[Overlay], dest_root: str | Path, builds: list[VllmBuild], torch_named: dict[str, str | None]
) -> list[VllmBuild]:
    """The overlays made under dest_root, each with its torch: the one --torch named for its label, else its base
    build's own (an overlay's compiled parts are its base's, linked against that torch), else the installed one."""
    base_torch = {str(Path(b.prefix).resolve()): b.torch_prefix for b in builds if b.prefix and b.torch_prefix}
    return [
        replace(o.make(dest_root), torch_prefix=torch_named.get(o.label) or base_torch.get(str(o.base.resolve())))
        for o in overlays
    ]


def parse_overlays(items: list[str]) -> list[Overlay]:
    """--overlay LABEL=SOURCES@BASE items, each judged (check_overlay); nothing is made."""
    out = []
    for item in items:
        label, sep, rest = item.partition("=")
        sources, at, base = rest.rpartition("@")
        if not sep or not at or not label or not sources or not base:
            raise ConfigError(
                f"--overlay: {item!r} is not LABEL=SOURCES@BASE (e.g. 0.24.0=/src/vllm-0.24.0@/opt/v0251)"
            )
        out.append(check_overlay(label, sources, base))
    return out


def needs_gpu(builds: list[VllmBuild]) -> bool:
    """Whether a build's cases need a GPU: a real vLLM ships compiled CUDA extensions (vllm/_C.abi3.so, ...), and a
    real vLLM's sources without them (a checkout, a wheel unpacked without its .so files: vllm/entrypoints/ is there)
    cannot run a case at all; a pure-Python stand-in (tests/fake_vllm.py, for the CPU tests) runs its cases without
    one."""
    for b in builds:
        pkg = b.package_dir
        if pkg is None or next(pkg.glob("*.so"), None) or next(pkg.glob("*/*.so"), None):
            return True
        if (pkg / "entrypoints").is_dir():
            return True
    return False


def source_text(path: Path) -> str:
    """A build's source file as text, read without importing vLLM; "" where the build has no such file (a release
    from before it) or it cannot be read: what the gate's features look for in a build (dynamic_k, sleep)."""
    try:
        return path.read_text()
    except OSError:
        return ""
