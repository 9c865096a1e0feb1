"""scripts/gpu_check.sh must not pass unless the CUDA checks really ran (checked here without a
GPU: what it does on one is only known once it runs there)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="checks the refusals on a machine without CUDA")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _module()


@pytest.mark.parametrize("python", [None, sys.executable])
def test_exits_nonzero_and_writes_nothing_without_cuda(tmp_path, python):
    env = dict(os.environ)
    env.pop("PYTHON", None)
    if python:
        env["PYTHON"] = python
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "nothing ran" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_kernel_tests_skipped_without_cuda_do_not_count(tmp_path):
    """The real kernel test file, run here: its CUDA tests skip, and that must fail the check."""
    xml = tmp_path / "k.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_kernels.py"), "-k",
                           "dispatch or host_transfer", f"--junitxml={xml}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    outcomes = gpu_check.junit_outcomes(xml)
    assert outcomes and proc.returncode == 0
    problems = " ".join(gpu_check.check_kernel_tests(outcomes, proc.returncode))
    assert "skipped that must run on CUDA" in problems
    assert "test_host_transfer_round_trip did not pass" in problems


def _cuda_outcomes() -> dict[str, str]:
    out = {f"{name}[x]": "passed" for name in gpu_check.CUDA_ONLY}
    out.update({f"{name}": "skipped" for name in gpu_check.CPU_ONLY})
    return out


def test_kernel_check_rules():
    assert gpu_check.check_kernel_tests(_cuda_outcomes(), 0) == []
    assert gpu_check.check_kernel_tests({}, 0) == [
        "no kernel test ran (none collected, or pytest did not start)"]
    failed = {**_cuda_outcomes(), "test_gather_matches_reference[y]": "failed"}
    assert "failed" in gpu_check.check_kernel_tests(failed, 1)[0]
    skipped = {**_cuda_outcomes(), "test_block_size_128[z]": "skipped"}
    assert "skipped" in gpu_check.check_kernel_tests(skipped, 0)[0]
    assert gpu_check.check_kernel_tests(_cuda_outcomes(), 3) == ["pytest exited with 3"]


def test_bench_check_rules(tmp_path):
    path = tmp_path / "b.json"
    row = {"correct": True, "gather/d2d": 0.9, "save": 1.0}
    path.write_text(json.dumps({"smoke": False, "rows": [row]}))
    assert gpu_check.check_bench(path, 0) == ([], [row])
    assert gpu_check.check_bench(path, 2)[0] == ["bench_kernels.py exited with 2"]
    path.write_text(json.dumps({"smoke": True, "rows": [row]}))
    assert gpu_check.check_bench(path, 0)[0] == ["bench_kernels.py ran no CUDA rows"]
    path.write_text(json.dumps({"smoke": False, "rows": [{**row, "correct": False}]}))
    assert "differed" in gpu_check.check_bench(path, 0)[0][0]
    assert gpu_check.check_bench(tmp_path / "none.json", 0)[0] == [
        "bench_kernels.py wrote no results"]


def test_mistral_check_rules():
    ok = {"test_a[standin]": "passed", "test_a[mistral-7b]": "skipped"}
    assert gpu_check.check_mistral(ok, 0, real_weights=False) == []
    assert gpu_check.check_mistral(ok, 0, real_weights=True) == [
        "Mistral-7B tests on mistral-7b did not all pass"]
    assert gpu_check.check_mistral({}, 5, real_weights=False) == ["no Mistral-7B test ran"]
