"""The plyx test matrix. Every session is generated from workspace.toml.

    nox -l                      # list sessions
    nox -s plane-specs-3.12     # one plane alone on one Python
    nox -t ci                   # what .ci/run runs

Sessions:
- ``plane-<name>[-<py>]``: a fresh venv holding only that plane, its declared
  plyx dependencies and its ``test`` extra; proves it installs and works alone.
  Torch-free planes run on every Python in ``workspace.pythons``.
- ``oldest-<name>``: the same with the lowest versions the ranges allow
  (``uv --resolution lowest-direct``) for the torch-free planes, and for the
  torch planes together in one venv (``oldest-torch``).
- ``contracts``: snapshot check (read-only) + conformance of every discovered implementation.
- ``wheelhouse``: the README's install lines verbatim (wheelhouse, then one plane and exactly its closure).
- ``integration``: all planes + the in-repo plugin distributions, cross-plane scenarios.
- ``lint``: ruff. ``workspace``: pyprojects agree with workspace.toml, no plyx/__init__.py.
- ``gpu``: kernel tests on CUDA; skips cleanly without a GPU.

torch is held at ``workspace.torch-constraint`` in every session through a
constraints file, ``oldest`` included: any other version pulls several GB.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "tools"))
import workspace

ROOT = Path(__file__).parent
DATA, MEMBERS = workspace.load(ROOT)
WS = DATA["workspace"]
MATRIX = DATA["matrix"]
CONSTRAINTS = ROOT / "constraints" / "torch.txt"
CONSTRAINTS.write_text(WS["torch-constraint"] + "\n")

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = []  # nothing runs without -s or -t

def _pyenv_versions() -> None:
    """Make every pyenv-installed Python visible as pythonX.Y (pyenv shims hide inactive ones)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if not root.is_dir():
        return
    wanted = [*WS["torch-pythons"], *WS["pythons"]]
    found = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    for minor in dict.fromkeys(wanted):
        candidates = sorted(p.name for p in root.glob(f"{minor}.*") if p.name.replace(".", "").isdigit())
        if candidates and candidates[-1] not in found:
            found.append(candidates[-1])
    if found:
        os.environ["PYENV_VERSION"] = ":".join(found)


_pyenv_versions()
# use the machine's interpreters; never download one (CI reaches package registries only)
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

# uv does not read pip's configuration; the local torch wheel lives there
FIND_LINKS = os.environ.get("PLYX_FIND_LINKS", "/opt/wheels")
ENV = {"UV_FIND_LINKS": FIND_LINKS, "PYTHONDONTWRITEBYTECODE": "1"} if Path(FIND_LINKS).is_dir() else {}


def _install(session: nox.Session, planes: list[str], *, extras: str = "test", resolution: str | None = None,
             more: tuple[str, ...] = ()) -> None:
    """Install ``planes`` (non-editable, as users get them) with their plyx deps from the tree."""
    order = workspace.closure(MEMBERS, planes)
    args = [str(MEMBERS[name].path) for name in order if name not in planes]
    args += [f"{MEMBERS[name].path}[{extras}]" for name in planes]
    flags = ["-c", str(CONSTRAINTS)]
    if resolution == "oldest":
        flags += ["--resolution", "lowest-direct"]
    session.install(*flags, *args, *more, env=ENV)


def _pytest(session: nox.Session, *paths: str, env: dict[str, str] | None = None) -> None:
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *paths, *session.posargs,
        env={"PLYX_STRICT_PLUGINS": "1", **(env or {})},
    )


def _plane_session(name: str, python: str | list[str], resolution: str | None, tags: list[str]) -> None:
    member = MEMBERS[name]
    prefix = "oldest" if resolution == "oldest" else "plane"

    @nox.session(name=f"{prefix}-{name}", python=python, tags=tags)
    def run(session: nox.Session) -> None:
        _install(session, [name], resolution=resolution)
        # nothing else was installed: the plane works alone and its plugin loads
        session.run("python", "-m", "plyx.specs", "plugins", env={"PLYX_STRICT_PLUGINS": "1"})
        tests = member.path / "tests"
        if any(tests.rglob("test_*.py")):
            _pytest(session, str(tests), env={"TRITON_INTERPRET": "1"} if member.torch else None)

    run.__doc__ = f"{member.distribution} alone ({resolution or 'latest'} resolution)"


for _name, _member in MEMBERS.items():
    _pythons = WS["torch-pythons"] if _member.torch else WS["pythons"]
    _plane_session(_name, _pythons, None, ["ci", "planes"])
    if "oldest" in MATRIX["resolutions"] and not _member.torch:
        _plane_session(_name, WS["torch-pythons"][0], "oldest", ["ci", "oldest"])


@nox.session(name="oldest-torch", python=WS["torch-pythons"][0], tags=["ci", "oldest"])
def oldest_torch(session: nox.Session) -> None:
    """Every torch plane in one venv at the lowest versions its ranges allow (torch held)."""
    torch_planes = [n for n, m in MEMBERS.items() if m.torch]
    _install(session, torch_planes, resolution="oldest")
    session.run("python", "-m", "plyx.specs", "plugins")
    _pytest(session, *(str(MEMBERS[n].path / "tests") for n in torch_planes), env={"TRITON_INTERPRET": "1"})


@nox.session(python=WS["torch-pythons"][0], tags=["ci"])
def contracts(session: nox.Session) -> None:
    """Frozen contract snapshots unchanged (or purely additive), and conformance of every implementation."""
    _install(session, list(MEMBERS), more=tuple(str(ROOT / p) for p in MATRIX["integration-plugins"]))
    # read-only: surfaces and frozen behaviour, then every discovered implementation through its kit
    session.run("python", "-m", "plyx.specs", "contracts", "check", "--conformance", "--dir", str(ROOT / "contracts"),
                env={"TRITON_INTERPRET": "1"})
    _pytest(session, str(ROOT / "integration" / "conformance"), env={"TRITON_INTERPRET": "1"})


#: the install lines of the READMEs, run verbatim in a fresh venv (a plane and exactly its plyx closure)
README_INSTALL = ("python tools/workspace.py wheels", "pip install --find-links dist/wheelhouse plyx-serve")
CLOSURE_CHECK = """
import sys, importlib.metadata as m
sys.path.insert(0, "tools")
import workspace
_, members = workspace.load()
want = sorted(members[n].distribution for n in workspace.closure(members, [sys.argv[1]]))
got = sorted(d.metadata["Name"] for d in m.distributions() if (d.metadata["Name"] or "").startswith("plyx-"))
assert got == want, f"installed {got}, the closure of {sys.argv[1]} is {want}"
print("installed exactly", ", ".join(got))
"""


@nox.session(python=WS["torch-pythons"][0], tags=["ci"])
def wheelhouse(session: nox.Session) -> None:
    """The README's install lines verbatim: every plane into dist/wheelhouse, then plyx-serve and exactly its closure."""
    session.install("pip", env=ENV)  # the README's lines use pip; uv-made venvs have none
    session.chdir(ROOT)
    for line in README_INSTALL:
        held = ["-c", str(CONSTRAINTS)] if line.startswith("pip") else []  # torch stays at the matrix's pin
        session.run(*line.split(), *held)
    session.run("python", "-c", CLOSURE_CHECK, "serve")
    session.run("plyx", "plugins", env={"PLYX_STRICT_PLUGINS": "1"})
    session.run("plyx", "train", success_codes=[2])  # not installed: names plyx-train and the install line


@nox.session(python=WS["torch-pythons"][0], tags=["ci"])
def integration(session: nox.Session) -> None:
    """All planes plus the in-repo third-party plugin distributions; cross-plane scenarios."""
    _install(session, list(MEMBERS), more=tuple(str(ROOT / p) for p in MATRIX["integration-plugins"]))
    plugin_tests = [str(ROOT / p / "tests") for p in MATRIX["integration-plugins"] if (ROOT / p / "tests").is_dir()]
    _pytest(session, str(ROOT / "integration" / "tests"), *plugin_tests, env={"TRITON_INTERPRET": "1"})


@nox.session(python=WS["torch-pythons"][0], tags=["ci"])
def workspace_check(session: nox.Session) -> None:
    """pyprojects agree with workspace.toml; the graph holds; no plyx/__init__.py; the check's own tests."""
    session.install("pytest>=8", str(MEMBERS["specs"].path), env=ENV)
    session.run("python", str(ROOT / "tools" / "workspace.py"), "check")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tools" / "tests"))


@nox.session(python=WS["torch-pythons"][0], tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff over every plane, the tools and the integration tree."""
    session.install("ruff>=0.6", env=ENV)
    session.run("ruff", "check", "packages", "tools", "integration", "noxfile.py")


@nox.session(python=False, tags=["gpu"])
def gpu(session: nox.Session) -> None:
    """GPU tests of the kernel plane in this interpreter (skips cleanly without CUDA)."""
    session.run(sys.executable, str(ROOT / "tools" / "gpu_run.py"), *session.posargs)
