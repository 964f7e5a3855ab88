"""The summaries of the recorded runs under results/ are generated from them, and a stale one fails here: the CPU
model's agreement with the GPU records, the shipped predictions, the xdist suite times the README quotes."""

from __future__ import annotations

import json
import re

import pytest

from tests.commands import run_repro
from tests.records import RESULTS, unpacked

REGENERATE = (
    "python -m repro records --unpack DIR && (cd DIR && python -m repro agree results/*/results.json --out "
    "results/model-agreement.md), then copy DIR/results/model-agreement.md to results/"
)


def test_model_agreement_summary_is_what_agree_writes_now(monkeypatch):
    from repro.report.agreement import compare, markdown
    from repro.report.redact import redact
    from repro.report.results import MODEL, is_vllm_gate_record, load_json

    top = unpacked()  # every record unpacked under top/results/NAME, so the summary names its sources results/...
    paths = sorted(str(p.relative_to(top)) for p in RESULTS.glob("*/results.json"))
    monkeypatch.chdir(top)
    paths = [p for p in paths if not is_vllm_gate_record(top / p)]  # `agree` leaves real-vLLM gate records out too
    measured = [p for p in paths if load_json(p).source != MODEL]
    assert len(measured) >= 17
    text = (RESULTS / "model-agreement.md").read_text()
    assert redact(markdown(compare(measured), measured)) == text, f"results/model-agreement.md is stale: {REGENERATE}"
    numbers = re.search(
        r"Verdicts agree in (\d+) of (\d+) cases; the faulting kernel agrees in (\d+) of (\d+) .*? "
        r"Descriptors agree in (\d+) of (\d+) cases",
        text,
    )
    quoted = (
        "{} of {} verdicts agree; the faulting kernel agrees in {} of {} memcheck cases; "
        "descriptors agree in {} of {} cases where the GPU named one"
    ).format(*numbers.groups())
    assert quoted in (RESULTS / "README.md").read_text(), f"results/README.md should say: {quoted}"


@pytest.mark.parametrize("folder, poison", [("model-int-max", "int-max"), ("model-nopoison", "none")])
def test_shipped_predictions_are_what_matrix_model_predicts_now(tmp_path, folder, poison):
    from repro.report.results import MODEL, load_json

    shipped = load_json(RESULTS / folder / "results.json")
    r = run_repro("matrix", "--model", "--poison", poison, "--json", str(tmp_path / "now.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    now = load_json(tmp_path / "now.json")

    def verdicts(run):
        return {s.case_id: (r.verdict, r.kernel, r.descriptor) for s, r in run.results}

    assert shipped.source == now.source == MODEL
    assert verdicts(shipped) == verdicts(now), (
        f"results/{folder} is stale: python -m repro matrix --model --poison {poison} --out results/{folder}"
    )


def test_xdist_summary_quotes_the_junit_suite_times():
    from repro.report.xdist import check_junit

    one, two = (check_junit(RESULTS / "h200x2-xdist" / f"junit-n{n}.xml").suite_seconds for n in (1, 2))
    quoted = f"16 cases in {two:.1f} s on 2 GPUs vs {one:.1f} s on 1 ({two / one:.2f}x"
    readme = (RESULTS / "README.md").read_text()
    assert quoted in readme, quoted
    assert f"took {two:.1f} s against {one:.1f} s for 16 on one worker" in readme
    for n, seconds in ((1, one), (2, two)):
        assert f"Suite time {seconds:.1f} s." in (RESULTS / "h200x2-xdist" / f"xdist-n{n}.md").read_text()


def test_every_release_the_gpu_table_names_gets_its_answer_from_the_kept_record():
    """results/vllm-gpu-records.json names a record per release; kept packed (NAME.tar.xz), each still answers
    (vllm-check read none of them once they were packed: "GPU record: none" for every release)."""
    from repro.vllm_integration.releases import compat
    from repro.vllm_integration.releases.source_check import BAD, GOOD

    table = json.loads(compat.GPU_RECORDS.read_text())
    for release, name in table.items():
        rec = compat.gpu_record(release)
        assert rec is not None and rec["record"] == f"results/{name}", release
    assert compat.gpu_record("0.25.1")["answer"] == BAD and compat.gpu_record("0.34.0")["answer"] == GOOD
