"""Run every GPU test and benchmark of plyx in one call on a GPU machine with no registry.

Here (with network):     python tools/gpu_run.py build      # wheels into .whl-plyx/
There (the GPU machine): python3 tools/gpu_run.py run [--out DIR] [--bench-only|--tests-only]

``build`` makes wheels of every plane and of the in-repo plugin distributions
with ``pip wheel --no-deps`` (plyx is pure Python), plus the peers the
benchmarks compare against (liger-kernel) for the GPU machine's Python.
``run`` installs them with ``--no-index --no-deps`` into a private target
directory put first on PYTHONPATH (the machine's torch and triton stay as they
are), runs the GPU tests of the torch planes, then each benchmark listed in
workspace.toml's ``matrix.gpu-benchmarks``, writing logs and results to --out.
Without CUDA it says so and exits 0: GPU sessions skip cleanly.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl-plyx"
# third-party wheels the GPU image lacks: plyx-specs' msgspec and importlib-metadata, and the
# peers the benchmarks compare against
PEERS = ["liger-kernel", "msgspec", "importlib-metadata"]
# what plyx-serve's server and structured output need on top (``run --planes serve``); pydantic and its
# core travel as a matched pair, since the target directory shadows the image's copies
SERVE_PEERS = ["xgrammar==0.2.8", "fastapi", "starlette", "uvicorn", "httpx", "httpcore", "anyio", "h11",
               "pydantic==2.14.3", "pydantic-core==2.50.4", "typing-inspection", "annotated-types", "annotated-doc",
               "prometheus-client", "sniffio", "opentelemetry-api"]
sys.path.insert(0, str(ROOT / "tools"))


def build() -> int:
    import workspace

    _, members = workspace.load(ROOT)
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("plyx*.whl"):
        old.unlink()
    paths = [str(m.path) for m in members.values()] + [str(p) for p in sorted((ROOT / "integration").glob("plyx-*"))]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEELS), *paths], check=True)
    subprocess.run([
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
        "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
        "-d", str(WHEELS), *PEERS, *SERVE_PEERS,
    ], check=True)
    print("\n".join(sorted(p.name for p in WHEELS.glob("*.whl"))))
    return 0


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    start = time.time()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    print(f"[{proc.returncode:>3}] {time.time() - start:6.1f}s  {' '.join(cmd[1:])}  -> {log.name}")
    tail = log.read_text(errors="replace").splitlines()[-15:]
    print("      " + "\n      ".join(tail))
    return proc.returncode


def run(out: Path, bench: bool, tests: bool, bench_args: list[str], extra_planes: list[str] | None = None) -> int:
    import tomllib
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: GPU tests and benchmarks skipped")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    site = Path("/tmp/plyx-site")
    # a fresh target: --upgrade would leave dist-info of removed planes pointing at missing modules
    shutil.rmtree(site, ignore_errors=True)
    # only the GPU planes and what they declare: a plane whose third-party dependencies the image lacks
    # (governance needs cryptography) would be a plugin that fails to import
    import workspace

    matrix = tomllib.loads((ROOT / "workspace.toml").read_text())["matrix"]
    _, members = workspace.load(ROOT)
    planes = matrix.get("gpu-planes", []) + list(extra_planes or [])
    wanted = {members[n].distribution.replace("-", "_") for n in workspace.closure(members, planes)}
    serve_peers = {p.split("=")[0].replace("-", "_").lower() for p in SERVE_PEERS}
    wheels = [w for w in WHEELS.glob("*.whl")
              if (w.name.split("-")[0] in wanted if w.name.startswith("plyx") else
                  "serve" in planes or w.name.split("-")[0].lower() not in serve_peers)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    env = {**os.environ, "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if not (tests or bench):
        print(f"installed into {site}: export PYTHONPATH={site}")
        return 0
    status = 0
    if tests:
        for plane in planes:
            # Triton compiles every kernel variant on first use: spread the tests over the host's cores
            status |= _run([sys.executable, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider",
                            f"packages/{plane}/tests"], out / f"tests-{plane}.log", env)
    if bench:
        for entry in matrix.get("gpu-benchmarks", []):
            name = Path(entry["script"]).stem
            target = out if entry.get("out", "dir") == "dir" else out / f"{name}.json"
            status |= _run([sys.executable, entry["script"], "--out", str(target), *bench_args],
                           out / f"bench-{name}.log", env)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["build", "run"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    parser.add_argument("--bench-only", action="store_true")
    parser.add_argument("--tests-only", action="store_true")
    parser.add_argument("--install-only", action="store_true", help="install into /tmp/plyx-site and stop")
    parser.add_argument("--planes", default="", help="comma list of planes to install and test beside gpu-planes")
    parser.add_argument("bench_args", nargs="*", help="passed to every benchmark")
    args = parser.parse_args()
    if args.action == "build":
        return build()
    extra = [p for p in args.planes.split(",") if p]
    return run(args.out, bench=not (args.tests_only or args.install_only),
               tests=not (args.bench_only or args.install_only), bench_args=args.bench_args,
               extra_planes=extra)


if __name__ == "__main__":
    sys.exit(main())
