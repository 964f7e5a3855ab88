"""The memcheck parser on logs recorded on the H200 (excerpts of runs recorded in results/)."""

import re

from repro.judge.memcheck_log import Finding, kernel_role, parse_log, short_kernel
from repro.run.sanitizer import ERROR_EXITCODE, sanitizer_command, sanitizer_env


def _log(fixtures, name):
    return (fixtures / "memcheck" / name).read_text()


def test_combine_over_read_past_lse_accum(fixtures):
    rep = parse_log(_log(fixtures, "combine-oob-upstream-16sm-nopoison.log"))
    assert len(rep.findings) == 1
    f = rep.findings[0]
    assert f.role == "combine" and short_kernel(f.kernel) == "FlashAttnFwdCombine"
    assert f.access == "global read of 4 bytes"
    # fp32 lse_accum [S=2, H=32, total_q=64] = 16 KiB: the combine reads splits past S
    assert (f.relation, f.alloc_size) == ("after", 16384)
    assert f.bytes_off == 261 and f.count == 6
    assert rep.first_role() == "combine" and rep.has_errors


def test_main_kernel_writes_with_error_summary(fixtures):
    rep = parse_log(_log(fixtures, "main-oob-vllm-16sm-intmax.log"))
    assert rep.error_summary == 258  # first summary line, not "58 errors were not printed"
    f = rep.findings[0]
    assert f.role == "main" and short_kernel(f.kernel) == "FlashAttnFwdSm90"
    assert f.access == "global write of 4 bytes" and f.relation == "before" and f.alloc_size == 65536


def test_main_kernel_read_with_thousands_separators(fixtures):
    f = parse_log(_log(fixtures, "main-oob-upstream-132sm-intmax.log")).findings[0]
    assert f.access == "global read of 16 bytes"
    assert f.bytes_off == 8_796_066_349_137 and f.alloc_size == 196_608
    assert "FlashAttnFwdSm90" in str(f)


def test_clean_log(fixtures):
    rep = parse_log(_log(fixtures, "clean-fresh.log"))
    assert rep.findings == [] and rep.error_summary == 0 and not rep.has_errors


def test_inside_and_api_error_variants():
    text = "\n".join(
        [
            "========= Invalid __global__ read of size 8 bytes",
            "=========     at flash::FlashAttnFwdCombine<int>::operator()+0x10 in x.h:3",
            "=========     Address 0x10 is inside the nearest allocation at 0x0 of size 1,024 bytes",
            '========= Program hit cudaErrorIllegalAddress (error 700) due to "an illegal memory access was encountered" on CUDA API call to cudaStreamSynchronize.',
            "========= ERROR SUMMARY: 2 errors",
        ]
    )
    rep = parse_log(text)
    assert rep.findings[0].relation == "inside" and rep.findings[0].alloc_size == 1024
    assert rep.findings[0].role == "combine"
    assert rep.api_errors == ["cudaStreamSynchronize: an illegal memory access was encountered"]
    assert rep.error_summary == 2


def test_kernel_roles():
    assert kernel_role("void flash::prepare_varlen_num_blocks_kernel<1, true>(int)") == "prepare"
    assert kernel_role("cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") == "main"
    assert kernel_role("void at::native::vectorized_elementwise_kernel") == "other"


def test_command_and_environment():
    cmd = sanitizer_command("cs", "/tmp/x.log", kernel_filter="flash")
    assert cmd[:3] == ["cs", "--tool", "memcheck"]
    assert cmd[cmd.index("--error-exitcode") + 1] == str(ERROR_EXITCODE)
    assert cmd[cmd.index("--kernel-name") + 1] == "kns=flash"
    env = sanitizer_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "0", "A": "1"})
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in env  # any value disables caching and breaks capture
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync" and env["A"] == "1"


def _first_block(block: str, name: str) -> Finding:
    """The finding memcheck's first error block states, read here line by line (no parser regex): the access from
    its `Invalid ...` line, the kernel from its last (outermost) `Device Frame:` (else its `at` line), where it points from its
    `nearest allocation` line; the role from the log's name (combine-oob-*, main-oob-*); count 1."""
    lines = [ln.removeprefix("=========").strip() for ln in block.splitlines()]
    words = lines[0].split()  # Invalid __global__ read of size 4 bytes
    assert words[0] == "Invalid" and words[4] == "size"
    access = f"{words[1].strip('_')} {words[2]} of {words[5]} bytes"
    frames = [ln.split("Device Frame:", 1)[1].strip() for ln in lines if ln.startswith("Device Frame:")]
    frames = frames or [lines[1].removeprefix("at ")]  # no device frames: the kernel is the `at` line's function
    kernel = frames[-1].rsplit("+0x", 1)[0]
    where = next(ln for ln in lines if "nearest allocation" in ln).split()  # and is N bytes after the nearest ...
    off, relation = int(where[where.index("bytes") - 1].replace(",", "")), where[where.index("bytes") + 1]
    size = int(where[where.index("size") + 1].replace(",", ""))
    return Finding(kernel, name.split("-")[0], access, relation, off, size, 1)


def test_first_finding_is_complete_only_once_its_block_ended(fixtures):
    """The early stop of a memcheck case waits for the first error's whole block: cut before its device frames, the
    parser would name the copy helper (role `other`) instead of the combine kernel."""
    from repro.judge.memcheck_log import first_finding_complete

    for log in sorted((fixtures / "memcheck").glob("*oob*.log")):
        text = log.read_text()
        first = text.index("Invalid ")
        end = re.compile(r"\n=+ *\n").search(text, first).start()  # the bare line that ends the first block
        for cut in (first + 10, text.index("nearest allocation", first), end):
            assert not first_finding_complete(text[:cut]), (log.name, cut)
        assert first_finding_complete(text[: text.index("\n", end + 1) + 1]), log.name
        (whole,) = parse_log(text[: text.index("\n", end + 1) + 1]).findings
        assert whole == _first_block(text[first:end], log.name), log.name
    cut = _log(fixtures, "combine-oob-upstream-16sm-nopoison.log")
    assert parse_log(cut[: cut.index("Device Frame")]).findings[0].role == "other"
    assert not first_finding_complete((fixtures / "memcheck" / "clean-fresh.log").read_text())
