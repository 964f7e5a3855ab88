"""The auditor as a CI gate for any vLLM program or test suite: `repro audit -- COMMAND` (command, judge, report) and
the pytest plugin for other projects' suites (pytest_audit)."""
