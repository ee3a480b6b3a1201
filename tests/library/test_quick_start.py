"""The quick start of ``docs/admission.md`` runs as written: every ``python``
block of its "Quick start" section, each in a fresh namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "admission.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def _quick_start_blocks() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## Quick start")
    end = text.index("\n## ", start + 1)
    return BLOCK.findall(text[start:end])


def test_the_quick_start_has_the_trio_asyncio_and_testing_blocks() -> None:
    blocks = _quick_start_blocks()
    assert len(blocks) == 3
    assert "trio.run(main)" in blocks[0] and "asyncio.run(main())" in blocks[1] and "MockClock" in blocks[2]


@pytest.mark.parametrize("index", range(3))
def test_quick_start_block_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    code = _quick_start_blocks()[index]
    exec(compile(code, f"{DOC.name} quick start block {index + 1}", "exec"), {"__name__": "quick_start"})
    out = capsys.readouterr().out
    if index == 0:
        assert out == "running on local/gpu0\n"
    if index == 1:
        assert "request 2 on local/gpu0" in out
