"""Everything that needs a CUDA GPU, in one run, with a results file to cite.

1. tests/test_kernels.py on CUDA: the Triton gather/scatter kernels bit for bit against the
   torch reference on every layout, and the pinned-host transfer path;
2. benchmarks/bench_kernels.py (Mistral-7B shapes): kernel and host-transfer bandwidth;
3. where vLLM for CUDA is installed, tests/test_mistral7b.py (on the real weights when
   KVCONNECTOR_MISTRAL_7B names a local copy of Mistral-7B-Instruct-v0.2).

Writes OUT/gpu_check.json (status, reasons, versions, device, test outcomes, bandwidth rows)
and OUT/gpu_check.log. Exits non-zero unless every part that must run did run and passed: no
CUDA device, no test collected, a CUDA test skipped or a benchmark without rows all fail it.

    python scripts/gpu_check.py [--out docs/results] [--require-vllm]
(scripts/gpu_check.sh installs what is missing first, then runs this.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Tests that only make sense without CUDA; every other kernel test must run and pass.
CPU_ONLY = ("test_dispatch_uses_reference_on_cpu", "test_cpu_tensors_without_interpreter_are_"
            "refused", "test_host_transfer_needs_cuda")
# Tests that are skipped without CUDA: at least one case of each must pass.
CUDA_ONLY = ("test_dispatch_uses_triton_on_cuda", "test_host_transfer_round_trip",
             "test_host_transfer_waits_for_compute_stream", "test_gather_matches_reference",
             "test_scatter_matches_reference")
REAL_WEIGHTS_ENV = "KVCONNECTOR_MISTRAL_7B"


def junit_outcomes(path: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from pytest's --junitxml file."""
    if not path.exists():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def _base(name: str) -> str:
    return name.split("[", 1)[0]


def check_kernel_tests(outcomes: dict[str, str], returncode: int) -> list[str]:
    """Why the kernel tests do not count as a CUDA run (empty when they do)."""
    problems = []
    if not outcomes:
        return ["no kernel test ran (none collected, or pytest did not start)"]
    failed = sorted(n for n, o in outcomes.items() if o == "failed")
    if failed:
        problems.append(f"kernel tests failed: {failed}")
    skipped = sorted(n for n, o in outcomes.items()
                     if o == "skipped" and _base(n) not in CPU_ONLY)
    if skipped:
        problems.append(f"kernel tests skipped that must run on CUDA: {skipped}")
    for name in CUDA_ONLY:
        if not any(_base(n) == name and o == "passed" for n, o in outcomes.items()):
            problems.append(f"{name} did not pass on CUDA")
    if returncode != 0 and not problems:
        problems.append(f"pytest exited with {returncode}")
    return problems


def check_bench(path: Path, returncode: int) -> tuple[list[str], list[dict]]:
    if returncode != 0:
        return [f"bench_kernels.py exited with {returncode}"], []
    if not path.exists():
        return ["bench_kernels.py wrote no results"], []
    data = json.loads(path.read_text())
    rows = data.get("rows", [])
    problems = []
    if data.get("smoke") or not rows:
        problems.append("bench_kernels.py ran no CUDA rows")
    if any(not r.get("correct") for r in rows):
        problems.append("bench_kernels.py: a kernel result differed from the reference")
    if any("save" not in r for r in rows):
        problems.append("bench_kernels.py: host transfer rows missing")
    return problems, rows


def check_mistral(outcomes: dict[str, str], returncode: int, real_weights: bool) -> list[str]:
    if not outcomes:
        return ["no Mistral-7B test ran"]
    problems = []
    failed = sorted(n for n, o in outcomes.items() if o == "failed")
    if failed:
        problems.append(f"Mistral-7B tests failed: {failed}")
    for param in ("standin", "mistral-7b") if real_weights else ("standin",):
        ran = [n for n, o in outcomes.items() if f"[{param}]" in n]
        if not ran or any(outcomes[n] != "passed" for n in ran):
            problems.append(f"Mistral-7B tests on {param} did not all pass")
    if returncode != 0 and not problems:
        problems.append(f"pytest exited with {returncode}")
    return problems


def versions() -> dict:
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "cuda": torch.version.cuda}
    for mod in ("triton", "vllm"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or not importable here
            out[mod] = None
    return out


def git_commit() -> str | None:
    """HEAD's id, or None where the tree came without git (a copied working tree)."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True)
    except OSError:  # no git installed
        return None
    return proc.stdout.strip() or None


def vllm_on_cuda() -> bool:
    code = ("from vllm.platforms import current_platform; "
            "raise SystemExit(0 if current_platform.is_cuda() else 1)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def bandwidth_summary(rows: list[dict]) -> dict:
    def worst(key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return round(min(vals), 3) if vals else None

    return {k: worst(k) for k in ("gather/d2d", "scatter/d2d", "save/d2h", "load/h2d")}


class Run:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.log = open(out / "gpu_check.log", "w")

    def __call__(self, name: str, cmd: list[str], env: dict | None = None) -> int:
        self.log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        self.log.flush()
        print(f"gpu_check: {name} ...", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        print(f"gpu_check: {name}: exit {proc.returncode}", flush=True)
        return proc.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "docs" / "results"),
                   help="folder for gpu_check.json, gpu_check.log and the raw outputs")
    p.add_argument("--require-vllm", action="store_true",
                   help="fail when vLLM for CUDA is not installed (Mistral-7B tests)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing ran",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    raw = out / "gpu_check"
    raw.mkdir(parents=True, exist_ok=True)
    run = Run(out)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    pytest = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"]

    result: dict = {"status": "fail", "reasons": [],
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "git_commit": git_commit(),
                    "device": torch.cuda.get_device_name(),
                    "device_count": torch.cuda.device_count(), "versions": versions()}

    xml = raw / "kernels.xml"
    rc = run("kernel tests", [*pytest, "tests/test_kernels.py", f"--junitxml={xml}"], env)
    outcomes = junit_outcomes(xml)
    result["kernel_tests"] = {"returncode": rc, "outcomes": outcomes,
                              "counts": {o: list(outcomes.values()).count(o)
                                         for o in ("passed", "failed", "skipped")}}
    result["reasons"] += check_kernel_tests(outcomes, rc)

    bench = raw / "bench_kernels.json"
    rc = run("kernel bandwidth", [sys.executable, "benchmarks/bench_kernels.py",
                                  "--out", str(bench)], env)
    problems, rows = check_bench(bench, rc)
    result["bandwidth"] = {"returncode": rc, "file": str(bench.relative_to(out)),
                           "worst_ratios": bandwidth_summary(rows), "rows": rows}
    result["reasons"] += problems

    real = os.environ.get(REAL_WEIGHTS_ENV)
    result["mistral7b"] = {"real_weights": real}
    if vllm_on_cuda():
        xml = raw / "mistral7b.xml"
        rc = run("Mistral-7B tests", [*pytest, "tests/test_mistral7b.py", f"--junitxml={xml}"],
                 env)
        outcomes = junit_outcomes(xml)
        result["mistral7b"].update(returncode=rc, outcomes=outcomes)
        result["reasons"] += check_mistral(outcomes, rc, bool(real))
    else:
        result["mistral7b"]["ran"] = False
        note = "vLLM for CUDA is not installed: Mistral-7B tests not run"
        result["notes"] = [note]
        print(f"gpu_check: {note}")
        if args.require_vllm:
            result["reasons"].append(note)

    result["status"] = "fail" if result["reasons"] else "pass"
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"gpu_check: {result['status']} on {result['device']}; wrote {out / 'gpu_check.json'}")
    for reason in result["reasons"]:
        print(f"  - {reason}")
    return 0 if result["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
