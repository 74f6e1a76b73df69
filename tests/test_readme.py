"""README.md stays true: its Python examples run, and CI runs the test command it gives.
The examples that moved from README to the documentation pages made of its sections
(docs/usage.md, docs/format.md) run here too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


# Examples with s3:// URLs need an S3 server: tests/test_s3_modes.py runs them against s3proxy.
PYTHON_BLOCKS = [b for b in _blocks("python") if "s3://" not in b]
# The pages README's sections moved to; their examples that README does not repeat.
DOC_PAGES = ["docs/usage.md", "docs/format.md"]
DOC_BLOCKS = [(page, b) for page in DOC_PAGES for b in _blocks("python", (ROOT / page).read_text(encoding="utf-8"))
              if "s3://" not in b and b not in PYTHON_BLOCKS]


def test_readme_has_examples() -> None:
    assert PYTHON_BLOCKS, "README.md has no ```python example"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_example_runs(tmp_path, index) -> None:
    """Each example runs as a user would run it: a fresh interpreter in an empty directory."""
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(PYTHON_BLOCKS[index], encoding="utf-8")
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"README example {index} failed:\n{PYTHON_BLOCKS[index]}\n{r.stderr}"


def test_docs_pages_made_of_readme_sections_have_their_examples() -> None:
    assert len(DOC_BLOCKS) >= 3, DOC_BLOCKS  # the I/O layer, loading into a model, safetensors


@pytest.mark.parametrize("index", range(len(DOC_BLOCKS)))
def test_moved_readme_example_runs(tmp_path, index) -> None:
    """As README's own: a fresh interpreter in an empty directory."""
    page, block = DOC_BLOCKS[index]
    script = tmp_path / f"doc_example_{index}.py"
    script.write_text(block, encoding="utf-8")
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"{page} example failed:\n{block}\n{r.stderr}"


def test_readme_opens_with_the_two_commands() -> None:
    bash = [b.strip() for b in _blocks("bash")]
    assert bash[0] == 'pip install ".[bench]" && fastpersist bench save --dir /path/on/your/disk'
    assert bash[1] == 'pip install -e ".[test]" && python -m pytest -q tests'


def test_ci_runs_the_readme_test_command() -> None:
    readme_test = _blocks("bash")[1].strip().split(" && ", 1)[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert readme_test in commands
    assert 'pip install -e ".[test]"' in commands


def test_ci_runs_the_readme_bench_command() -> None:
    """CI runs README's first command as written, only its placeholder directory replaced."""
    first = _blocks("bash")[0].strip()
    placeholder = "/path/on/your/disk"
    assert placeholder in first
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert first.replace(placeholder, '"$BENCH_DIR"') in commands
