"""Kernel routing is configuration: no environment read changes a traced program (issue 40, part 3).

The package's Python may read only path, cache and memory variables from the environment, and the plugins'
sources none at all; the routing they once read (dense-copy thresholds, the GPU's tensor-core mode) is a
`KernelPolicy` in the static step options (test_packed_model.py checks that two policies give two programs).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the package may read: where plugins and caches live, how much device memory JAX takes.
ALLOWED = {"DSPARKJAX_LIB_DIR", "DSPARKJAX_CACHE", "DSPARKJAX_XLA_CACHE", "DSPARKJAX_CACHE_MAX_SIZE",
           "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
_READ = re.compile(r"os\.environ\.get\(\s*([A-Za-z_\"']\w*[\"']?)|os\.environ\[\s*([\"']?\w+[\"']?)\s*\]|"
                   r"os\.getenv\(\s*([\"']?\w+[\"']?)|([\"']\w+[\"'])\s+(?:not\s+)?in\s+os\.environ")


def _constant(name: str, text: str) -> str:
    """A module constant's string value (`CACHE_ENV = "..."`), or the name itself when it is a literal."""
    if name[0] in "\"'":
        return name.strip("\"'")
    found = re.search(rf"^{name}\s*=\s*[\"'](\w+)[\"']", text, re.MULTILINE)
    assert found, f"environment read through {name}, whose value this test cannot see"
    return found.group(1)


def test_the_package_reads_no_routing_variable():
    read: dict[str, str] = {}
    for path in sorted((ROOT / "dsparkjax").rglob("*.py")):
        text = path.read_text()
        for match in _READ.finditer(text):
            name = next(g for g in match.groups() if g)
            read[_constant(name, text)] = str(path.relative_to(ROOT))
        assert "getenv(" not in text.replace("os.getenv(", ""), path
    assert read, "the pattern found no environment read at all: it no longer matches the package's code"
    unexpected = {name: where for name, where in read.items() if name not in ALLOWED}
    assert not unexpected, f"environment variables that may change a traced program: {unexpected}"


def test_the_plugins_read_no_environment():
    sources = [p for p in (ROOT / "custom_calls").iterdir() if p.suffix in {".cc", ".cu", ".cuh", ".h"}]
    assert sources
    readers = [str(p.name) for p in sources if re.search(r"\bgetenv\b|\benviron\b", p.read_text())]
    assert not readers, f"plugin sources that read the environment: {readers}"


def test_tuning_comments_link_to_existing_sections():
    """Every `docs/kernels.md#anchor` the sources cite names a heading of docs/kernels.md (GitHub's anchors)."""
    headings = re.findall(r"^#+ (.+)$", (ROOT / "docs" / "kernels.md").read_text(), re.MULTILINE)
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    sources = [*(ROOT / "custom_calls").iterdir(), *(ROOT / "dsparkjax").rglob("*.py")]
    cited = {a for p in sources if p.is_file() for a in re.findall(r"docs/kernels\.md#([\w-]+)", p.read_text())}
    assert cited, "no source cites a docs/kernels.md section"
    assert cited <= anchors, f"links to missing sections: {sorted(cited - anchors)}"
