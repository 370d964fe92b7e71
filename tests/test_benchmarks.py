"""The benchmarks still run, and the results page is what the renderer makes of the stored results.

Every suite of benchmarks/registry.py runs with --quick (the tiny towers, the fewest calls) and
--in-process (its workers in this process where it asks for no other interpreter), writing its
result to a temporary folder, the bench cache a temporary one too. The figures of a quick run mean
nothing: the test checks that the suite runs end to end, that its result records what the page
names (revision, CPU, versions, the command) and that its report renders it. A suite whose point is
a process boundary (a server, a signal, the CLI) still starts those processes.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import __main__ as runner
from benchmarks import common, render
from benchmarks.registry import SUITES

MAX_PAGE_LINES = 560


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory):
    """A bench cache of this module's own (checkpoints, inputs), and the in-process switch put back."""
    mp = pytest.MonkeyPatch()
    mp.setenv("QVJ_BENCH_CACHE", str(tmp_path_factory.mktemp("bench_cache")))
    mp.delenv("VIDEO_REF_PYTHON", raising=False)  # HF's torchvision side needs the reference venv
    mp.delenv("EASYDEL_PYTHON", raising=False)
    yield
    mp.undo()
    common.IN_PROCESS = False


@pytest.mark.parametrize("suite", list(SUITES))
def test_every_suite_runs_quick(suite, bench_cache, tmp_path):
    out = tmp_path / f"{suite}.json"
    assert runner.main([suite, "--quick", "--in-process", "--out", str(out), "--note", "a quick check"]) == 0
    result = json.loads(out.read_text())
    assert (result["suite"], result["quick"], result["notes"]) == (suite, True, ["a quick check"])
    assert result["command"] == f"python -m benchmarks {suite} --quick"
    assert len(result["revision"]["hash"]) == 40 and result["machine"]["lscpu_model"]
    assert {"jax", "numpy", "python"} <= result["versions"].keys()
    assert "|---|" in SUITES[suite].module().report(result)  # a table, from the stored form


def test_the_page_is_the_rendering_of_the_stored_results():
    """RESULTS.md is what `python -m benchmarks render` makes of results/*.json: never edited by hand."""
    page = render.page()
    assert render.PAGE.read_text() == page, "RESULTS.md is stale: run `python -m benchmarks render`"
    assert page.count("\n") <= MAX_PAGE_LINES
    stored = render.stored()
    assert stored, "no stored result"
    for suite, results in stored.items():
        for r in results:
            assert not r["quick"], f"{r['file']}: a --quick result"
            assert r["command"].startswith(f"python -m benchmarks {suite}"), r["file"]
            assert r["machine"].get("description") or r["machine"].get("lscpu_model"), r["file"]
            assert f"`{r['command']}`" in page


def test_the_runner_refuses_what_a_suite_does_not_take(capsys):
    """The shared flags a suite does not take are usage errors, not ignored (compile has no --against)."""
    with pytest.raises(SystemExit) as e:
        runner.main(["compile", "--against", "HEAD"])
    assert e.value.code == 2
    assert "--against" in capsys.readouterr().err
    assert runner.main([]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in SUITES)
