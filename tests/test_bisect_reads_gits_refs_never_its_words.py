"""`repro bisect` reads its answer from git's bisect refs (refs/bisect/bad, good-*, skip-*) and exit codes, never from
git's messages: a git that speaks another language (its own translations under LANGUAGE, and a stand-in git on PATH
whose every English answer line is reworded, as a git of another release or locale may word it) still names the first
bad commit, says when only untestable commits were left (exit 125), and names --bad when nothing lies between."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.commands import main_in
from tests.fake_vllm import MANAGER_BAD, MANAGER_GOOD, write_manager_history

# git's English answers, each as a git in another language words it (its translations do not cover these in every
# release: the stand-in makes sure none is left in English)
REWORDED = (
    ("is the first bad commit", "ist der erste fehlerhafte Commit"),
    ("There are only 'skip'ped commits left to test.", "Es sind nur noch übersprungene Commits zu testen."),
    ("The first bad commit could be any of:", "Der erste fehlerhafte Commit könnte jeder dieser sein:"),
    ("We cannot bisect more!", "Keine binäre Suche mehr möglich!"),
    ("bisect run cannot continue any more", "'bisect run' kann nicht mehr fortgesetzt werden"),
)

STAND_IN = """\
import subprocess, sys
r = subprocess.run([{git!r}, *sys.argv[1:]], capture_output=True)
for stream, data in ((sys.stdout.buffer, r.stdout), (sys.stderr.buffer, r.stderr)):
    for english, other in {words!r}:
        data = data.replace(english.encode(), other.encode())
    stream.write(data)
sys.exit(r.returncode)
"""


def _german_git(tmp_path: Path) -> dict[str, str]:
    """The environment of a bisect run by a git that speaks German: LANGUAGE=de, and `git` on PATH a stand-in that
    runs the real git and rewords its English answers (REWORDED)."""
    folder = tmp_path / "german-git"
    folder.mkdir()
    script = folder / "git"
    script.write_text(f"#!{sys.executable}\n" + STAND_IN.format(git=shutil.which("git"), words=REWORDED))
    script.chmod(0o755)
    path = f"{folder}:{Path(sys.executable).parent}:/usr/bin:/bin"
    return {"PATH": path, "LANGUAGE": "de", "LC_ALL": "C.UTF-8", "LANG": "de_DE.UTF-8"}


def test_the_stand_in_git_speaks_no_english_answer(tmp_path):
    """The stand-in does what the tests below rely on: git's answer line comes back in German."""
    write_manager_history(tmp_path / "repo", [MANAGER_BAD])
    env = _german_git(tmp_path)
    said = subprocess.run(
        ["git", "-C", str(tmp_path / "repo"), "bisect", "start", "HEAD", "HEAD~1"],
        capture_output=True,
        text=True,
        env=env,
    )
    subprocess.run(["git", "-C", str(tmp_path / "repo"), "bisect", "reset"], capture_output=True, env=env)
    assert "ist der erste fehlerhafte Commit" in said.stdout and "is the first bad commit" not in said.stdout


def test_a_git_speaking_german_still_names_the_first_bad_commit_without_its_diffstat(tmp_path):
    shas = write_manager_history(
        tmp_path / "repo", [MANAGER_GOOD + "\n# 0\n", MANAGER_GOOD + "\n# 1\n", MANAGER_BAD, MANAGER_BAD + "\n#\n"]
    )
    r = main_in(["bisect", "--vllm", "repo", "--good", "HEAD~4", "--bad", "HEAD"], tmp_path, **_german_git(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"first bad commit: {shas[2]} change 2" in r.stdout, r.stdout
    assert "ist der erste" not in r.stdout and "file changed" not in r.stdout  # its answer line and diffstat left out


def test_a_git_speaking_german_still_says_only_untestable_commits_were_left(tmp_path):
    broken = "def capture(:\n"  # the source check cannot read it: untestable, each step exits 125
    write_manager_history(tmp_path / "repo", [broken, broken + "# 1\n", broken + "# 2\n"])
    r = main_in(["bisect", "--vllm", "repo", "--good", "HEAD~3", "--bad", "HEAD"], tmp_path, **_german_git(tmp_path))
    assert r.returncode == 125, r.stdout + r.stderr
    assert "every commit left was untestable" in r.stderr and "first bad commit:" not in r.stdout, r.stderr


def test_a_git_speaking_german_still_names_bad_when_nothing_lies_between(tmp_path):
    shas = write_manager_history(tmp_path / "repo", [MANAGER_GOOD + "\n# 0\n", MANAGER_BAD, MANAGER_GOOD + "\n#\n"])
    env = _german_git(tmp_path)
    r = main_in(["bisect", "--vllm", "repo", "--good", "HEAD~2", "--bad", "HEAD~1"], tmp_path, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"first bad commit: {shas[1]} change 1" in r.stdout, r.stdout
    assert "no commit lies between --good HEAD~2 and --bad HEAD~1: git named --bad, no check ran" in r.stdout
    head = subprocess.run(["git", "-C", str(tmp_path / "repo"), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head.stdout.strip() == shas[2]  # the checkout given back as it was
