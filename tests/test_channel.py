"""The structured channel (repro.contract.channel): records with a schema in a file of their own, errors under any tag, and
the tagged lines of the recorded logs still readable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from repro.contract.channel import ENV, SCHEMA, Channel, emit, path_for
from repro.contract.tags import AUDIT_TAG, PLUGIN_TAG, RESULT_TAG
from tests.records import RESULTS

ROOT = Path(__file__).resolve().parent.parent


def test_records_go_to_the_channel_not_the_log(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.channel.jsonl"
    monkeypatch.setenv(ENV, str(path))
    emit(RESULT_TAG, {"passes": 3})
    emit(AUDIT_TAG, {"error": "cannot patch FlashAttentionMetadataBuilder.build"})
    assert capsys.readouterr().out == ""
    ch = Channel.read(path)
    assert ch.last(RESULT_TAG) == {"passes": 3} and ch.source == "channel"
    assert ch.errors() == [f"{AUDIT_TAG}: cannot patch FlashAttentionMetadataBuilder.build"]  # an error under any tag
    assert all(json.loads(ln)["schema"] == SCHEMA for ln in path.read_text().splitlines() if ln)


def test_without_a_channel_a_tagged_line_is_printed(monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    emit(PLUGIN_TAG, {"installed": "audit"})
    out = capsys.readouterr().out
    assert out == 'REPRO_PLUGIN {"installed": "audit"}\n'
    assert Channel.from_output(out).of(PLUGIN_TAG) == [{"installed": "audit"}]


def test_unknown_tags_are_refused_at_the_writer():
    with pytest.raises(ValueError, match="unknown channel tag"):
        emit("REPRO_RESUlT", {})


def test_malformed_lines_are_problems_not_silence(tmp_path):
    path = tmp_path / "x.channel.jsonl"
    good = json.dumps({"schema": SCHEMA, "tag": RESULT_TAG, "pid": 1, "data": {"ok": 1}})
    path.write_text(
        "\n".join([good, '{"schema": 1, "tag": "REPRO_RESULT", "pid": 1, "da', '{"schema": 0, "tag": "REPRO_RESULT"}',
                   json.dumps({"schema": SCHEMA, "tag": "OTHER", "data": {}})]) + "\n"
    )  # fmt: skip
    ch = Channel.read(path)
    assert ch.of(RESULT_TAG) == [{"ok": 1}] and len(ch.problems) == 3
    assert len(ch.errors()) == 3 and all(e.startswith("channel: line") for e in ch.errors())


def test_log_text_that_looks_like_a_tag_is_not_a_record():
    ch = Channel.from_output('REPRO_RESULT is printed at the end\nREPRO_RESULT {"passes": 1}\n')
    assert ch.of(RESULT_TAG) == [{"passes": 1}]


def test_recorded_logs_read_as_before():
    """A log recorded on the H200 before the channel: its tagged lines are the records (Channel.of_case falls back)."""
    log = next((RESULTS / "h200-vllm-coverage" / "logs").glob("*0.26.0-under-test-audit.out.log"))
    ch = Channel.of_case(log)
    assert ch.source == "output" and ch.last(RESULT_TAG)["vllm_version"] == "0.26.0" and not ch.errors()
    assert path_for(log).name.endswith("0.26.0-under-test-audit.channel.jsonl")


def test_a_child_process_writes_through_the_environment(tmp_path):
    path = tmp_path / "child.channel.jsonl"
    code = "from repro.contract.channel import emit; emit('REPRO_SKIP', {'reason': 'why'}); print('free text')"
    r = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, ENV: str(path)},
                       capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert r.stdout == "free text\n" and Channel.read(path).of("REPRO_SKIP") == [{"reason": "why"}]
