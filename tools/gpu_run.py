"""Run every GPU test and benchmark of plyx in one call on a GPU machine with no registry.

Here (with network):     python tools/gpu_run.py build [--planes serve]   # wheels into .whl-plyx/
There (the GPU machine): python3 tools/gpu_run.py run [--planes serve [--only]] [--out DIR] [--bench-only|--tests-only]

``build`` makes wheels of every plane and of the in-repo plugin distributions
with ``pip wheel --no-deps`` (plyx is pure Python), and downloads, for the GPU
machine's Python (CPython 3.12, manylinux x86-64), every third-party package the
planes it will run need that the machine's image lacks: their dependencies, their
``test`` extras (``openai``, ``jsonschema``, ``xgrammar`` and its ``apache-tvm-ffi``
...), and those packages' own dependencies, read from each downloaded wheel's
metadata; plus the peers the benchmarks compare against (liger-kernel). A peer
installed here travels in the version installed here (what this checkout is
tested with). ``.whl-plyx/peers.json`` records which wheels each plane needs.

``run`` installs them with ``--no-index --no-deps`` into a private target
directory put first on PYTHONPATH (the machine's torch and triton stay as they
are), reports any requirement still unmet there, runs the GPU tests of the torch
planes (``gpu-planes`` of workspace.toml, plus ``--planes``), then each benchmark
listed in ``matrix.gpu-benchmarks``, writing logs and results to --out. Without
CUDA it says so and exits 0: GPU sessions skip cleanly.

Why xgrammar did not import there (2026-11-24): xgrammar 0.2.8's native module
(``libxgrammar_bindings.so``) links ``libtvm_ffi.so`` and its Python side imports
``tvm_ffi`` (``Requires-Dist: apache-tvm-ffi>=0.1.11``); only xgrammar's own
wheel travelled, so ``import xgrammar`` failed with ``No module named 'tvm_ffi'``.
It needs no particular torch (``torch>=1.10``; its CUDA mask kernel is compiled on
first use, its Triton and CPU ones need nothing), and transformers, triton and
numpy are on the image. Reading each wheel's requirements now carries tvm-ffi.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl-plyx"
MANIFEST = "peers.json"
# peers the benchmarks compare against (not a plane's requirement)
BENCH_PEERS = ["liger-kernel"]
# planes whose peers `build` fetches by default beside gpu-planes (the coordinator runs `run --planes serve`)
DEFAULT_EXTRA_PLANES = ["serve"]
# a requirement pinned here travels in this version whatever is installed locally (xgrammar: the oldest release
# whose length-bounded JSON strings keep maxLength with non-ASCII text, the one plyx-serve's tests pin down)
PINS = {"xgrammar": "==0.2.8"}
# the GPU machine's Python, for pip download and for the requirements' environment markers
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
# the distributions of the GPU machine's image ('cuda', as /work/.library/device/KINDS.md lists them on
# 2026-11-17): never carried, so the machine's torch, triton, numpy and transformers stay the ones in use
IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
sys.path.insert(0, str(ROOT / "tools"))


def _canon(name: str) -> str:
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


def _plane_requirements(member) -> list[str]:
    """The third-party requirements of one plane: its dependencies and its ``test`` extra (plyx-* are wheels
    of their own)."""
    import tomllib

    project = tomllib.loads((member.path / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", [])) + list(project.get("optional-dependencies", {}).get("test", []))
    return [r for r in reqs if not _canon(r.split(";")[0].strip()).startswith("plyx")]


def _wheel_of(name: str) -> Path | None:
    for w in WHEELS.glob("*.whl"):
        if _canon(w.name.split("-")[0]) == name:
            return w
    return None


def _wheel_requirements(wheel: Path) -> list[str]:
    """``Requires-Dist`` lines of a wheel whose markers hold on the GPU machine (extras left out)."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(TARGET_ENV):
                out.append(str(req))
    return out


def _download(req: str) -> Path:
    """The wheel of one requirement for the GPU machine (the version installed here when it fits)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    r = Requirement(req)
    name = _canon(r.name)
    spec = PINS.get(name, "")
    if not spec:
        try:
            local = version(r.name)
            spec = f"=={local}" if r.specifier.contains(local, prereleases=True) else str(r.specifier)
        except PackageNotFoundError:
            spec = str(r.specifier)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(WHEELS),
                    f"{r.name}{spec}"], check=True)
    wheel = _wheel_of(name)
    if wheel is None:
        raise SystemExit(f"pip downloaded no wheel for {r.name}{spec}")
    return wheel


def _peers(requirements: list[str], fetched: dict[str, Path]) -> list[str]:
    """The wheels (file names) of ``requirements`` and of everything they need that the image lacks, fetching
    what ``fetched`` does not hold yet."""
    from packaging.requirements import Requirement

    names: list[str] = []
    queue = list(requirements)
    while queue:
        req = queue.pop(0)
        name = _canon(Requirement(req).name)
        if name in IMAGE or name.startswith("plyx") or name in names:
            continue
        if name not in fetched:
            fetched[name] = _download(req)
            print(f"  {fetched[name].name}")
        names.append(name)
        queue += _wheel_requirements(fetched[name])
    return sorted(fetched[n].name for n in names)


def build(extra_planes: list[str]) -> int:
    import tomllib
    import workspace  # tools/ is on sys.path

    _, members = workspace.load(ROOT)
    matrix = tomllib.loads((ROOT / "workspace.toml").read_text())["matrix"]
    # a fresh directory: a stale peer of another version would stop the install there (two versions of one name)
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir()
    paths = [str(m.path) for m in members.values()] + [str(p) for p in sorted((ROOT / "integration").glob("plyx-*"))]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEELS), *paths], check=True)
    planes = workspace.closure(members, matrix.get("gpu-planes", []) + extra_planes)
    fetched: dict[str, Path] = {}
    manifest = {"bench": _peers(BENCH_PEERS, fetched), "planes": {}}
    for plane in planes:
        print(f"{plane}:")
        manifest["planes"][plane] = _peers(_plane_requirements(members[plane]), fetched)
    (WHEELS / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print("\n".join(sorted(p.name for p in WHEELS.glob("*.whl"))))
    size = sum(p.stat().st_size for p in WHEELS.glob("*.whl"))
    print(f"{len(list(WHEELS.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    return 0


def _unmet(site: Path, requirements: list[str]) -> list[str]:
    """Requirements not satisfied by the target directory and the image together (checked where they run)."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    missing = []
    for req in dict.fromkeys(requirements):
        r = Requirement(req)
        if r.marker is not None and not r.marker.evaluate():
            continue
        try:
            found = version(r.name)
        except PackageNotFoundError:
            missing.append(f"{req} (not installed)")
            continue
        if r.specifier and not r.specifier.contains(found, prereleases=True):
            missing.append(f"{req} (found {found})")
    sys.path.remove(str(site))
    return missing


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    start = time.time()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    print(f"[{proc.returncode:>3}] {time.time() - start:6.1f}s  {' '.join(cmd[1:])}  -> {log.name}")
    tail = log.read_text(errors="replace").splitlines()[-15:]
    print("      " + "\n      ".join(tail))
    return proc.returncode


def select(planes: list[str]) -> tuple[list[str], list[Path], list[str]]:
    """(the planes' closure, the wheels to install for it, what they all require): the plyx wheels of the
    closure, the peers ``build`` recorded for each of its planes, and the requirements of both, which the
    run checks against what is installed (a gap is a test that fails on an import: say it first)."""
    import workspace  # tools/ is on sys.path

    _, members = workspace.load(ROOT)
    closure = workspace.closure(members, planes)
    wanted = {members[n].distribution.replace("-", "_") for n in closure}
    manifest = json.loads((WHEELS / MANIFEST).read_text())
    unbuilt = [n for n in closure if n not in manifest["planes"]]
    if unbuilt:
        raise SystemExit(f"the wheels of {', '.join(unbuilt)} were not built: run `python tools/gpu_run.py build "
                         f"--planes {','.join(unbuilt)}` where pip reaches a registry")
    peers = set(manifest["bench"]).union(*(manifest["planes"][n] for n in closure))
    wheels = [w for w in WHEELS.glob("*.whl")
              if (w.name.split("-")[0] in wanted if w.name.startswith("plyx") else w.name in peers)]
    requirements = [r for n in closure for r in _plane_requirements(members[n])]
    requirements += [r for w in wheels if not w.name.startswith("plyx") for r in _wheel_requirements(w)]
    return closure, wheels, requirements


def run(out: Path, bench: bool, tests: bool, bench_args: list[str], extra_planes: list[str] | None = None,
        only: bool = False) -> int:
    import tomllib
    import torch  # the image's

    if not torch.cuda.is_available():
        print("no CUDA device: GPU tests and benchmarks skipped")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    site = Path("/tmp/plyx-site")
    # a fresh target: --upgrade would leave dist-info of removed planes pointing at missing modules
    shutil.rmtree(site, ignore_errors=True)
    # only the GPU planes and what they declare: a plane whose third-party dependencies the image lacks
    # (governance needs cryptography) would be a plugin that fails to import
    matrix = tomllib.loads((ROOT / "workspace.toml").read_text())["matrix"]
    planes = ([] if only else matrix.get("gpu-planes", [])) + list(extra_planes or [])
    closure, wheels, requirements = select(planes)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    unmet = _unmet(site, requirements)
    print("requirements: " + ("all met" if not unmet else "UNMET " + "; ".join(unmet)))
    env = {**os.environ, "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    # tvm-ffi (under xgrammar) otherwise JIT-builds a torch DLPack add-on into ~/.cache on first import where
    # torch lacks the exchange API, once per pytest worker at the same time; it is a speed-up of tensor
    # hand-over that plyx's grammar masks do not need (xgrammar falls back to standard DLPack)
    env.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    if "serve" in closure:  # structured output's engine: a native module, so import it where it runs
        probe = subprocess.run([sys.executable, "-c", "import xgrammar, tvm_ffi; print(tvm_ffi.__version__)"],
                               env=env, capture_output=True, text=True)
        tail = (probe.stdout + probe.stderr).strip().splitlines()[-1:] or [""]
        print(f"xgrammar: {'imports (tvm-ffi ' + tail[0] + ')' if probe.returncode == 0 else 'FAILS: ' + tail[0]}")
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
    parser.add_argument("--planes", default=None,
                        help="comma list of planes to install and test beside gpu-planes (build: whose peers to "
                             f"fetch; default {','.join(DEFAULT_EXTRA_PLANES)})")
    parser.add_argument("--only", action="store_true",
                        help="test only --planes (gpu-planes are then installed only where those depend on them)")
    parser.add_argument("bench_args", nargs="*", help="passed to every benchmark")
    args = parser.parse_args()
    if args.action == "build":
        return build(DEFAULT_EXTRA_PLANES if args.planes is None else [p for p in args.planes.split(",") if p])
    extra = [p for p in (args.planes or "").split(",") if p]
    return run(args.out, bench=not (args.tests_only or args.install_only),
               tests=not (args.bench_only or args.install_only), bench_args=args.bench_args,
               extra_planes=extra, only=args.only)


if __name__ == "__main__":
    sys.exit(main())
