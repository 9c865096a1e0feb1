"""Model builds that several processes start at once (the suite's parallel workers, two
examples): exactly one builds, the others wait and find the build complete; a build that
fails leaves no marker, so the next call builds again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvconnector.build_once import build_once, is_built
from tests.conftest import ROOT

WANT = {"v": 1}

BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvconnector.build_once import build_once
    model, log = Path(sys.argv[1]), Path(sys.argv[2])
    with build_once(model / "marker.json", {"v": 1}) as needed:
        if needed:
            with open(log, "a") as f:
                f.write("built\\n")
            (model / "weights").write_text("half")
            time.sleep(1.0)  # a reader now would find half a build
            (model / "weights").write_text("whole")
    print((model / "weights").read_text())
""")


def test_processes_started_together_build_once_and_all_find_it_whole(tmp_path):
    model, log = tmp_path / "model", tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(model), str(log)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert log.read_text() == "built\n"
    assert outs == ["whole"] * 3
    assert is_built(model / "marker.json", WANT)


def test_a_failed_build_leaves_no_marker_and_is_built_again(tmp_path):
    marker = tmp_path / "model" / "marker.json"
    with pytest.raises(RuntimeError), build_once(marker, WANT) as needed:
        assert needed
        raise RuntimeError("the build failed")
    assert not marker.exists()
    with build_once(marker, WANT) as needed:
        assert needed
    assert is_built(marker, WANT)
    with build_once(marker, WANT) as needed:
        assert not needed


def test_a_marker_of_another_build_is_built_over(tmp_path):
    marker = tmp_path / "model" / "marker.json"
    marker.parent.mkdir()
    marker.write_text('{"v": 0}')
    with build_once(marker, WANT) as needed:
        assert needed
        assert not marker.exists()  # a build cut short is never taken for the old one
    assert is_built(marker, WANT)
