"""Read ``workspace.toml`` and check that every plane agrees with it.

    python tools/workspace.py check      # exit 1 naming every disagreement
    python tools/workspace.py members    # one line per plane (used by scripts)
    python tools/workspace.py wheels [--out DIR] [PLANE ...]
                                         # a wheelhouse of every plane (or of PLANEs' closures), default
                                         # dist/wheelhouse; then `pip install --find-links DIR plyx-serve`
                                         # installs exactly plyx-serve and the planes it depends on

Checks:
- each member's pyproject: distribution name, version, internal dependency
  ranges exactly as declared, no internal dependency that is not declared,
  torch declared as a range (never pinned) exactly when ``torch = true``,
  hatchling as the build backend, the ``plyx`` entry point of its plugin;
- the graph: every edge points to a lower ``layer`` (nothing imports upward)
  and every declared range admits the dependency's current version;
- sources: no ``plyx/__init__.py`` in any distribution (PEP 420), and no
  ``import plyx.X`` of a plane the importer does not depend on;
- numpy: plyx-kernel declares it (torch warns "Failed to initialize NumPy" on
  every command of an install without it, and every torch plane gets it
  through plyx-kernel).
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Member:
    name: str
    path: Path
    distribution: str
    version: str
    layer: int
    torch: bool
    depends: dict[str, str] = field(default_factory=dict)


def load(root: Path = ROOT) -> tuple[dict, dict[str, Member]]:
    data = tomllib.loads((root / "workspace.toml").read_text(encoding="utf-8"))
    members = {
        name: Member(
            name=name,
            path=root / m["path"],
            distribution=m["distribution"],
            version=m["version"],
            layer=int(m["layer"]),
            torch=bool(m["torch"]),
            depends=dict(m.get("depends", {})),
        )
        for name, m in data["members"].items()
    }
    return data, members


def closure(members: dict[str, Member], names: list[str]) -> list[str]:
    """``names`` and everything they depend on, dependencies first."""
    order: list[str] = []

    def visit(name: str) -> None:
        for dep in members[name].depends:
            visit(dep)
        if name not in order:
            order.append(name)

    for name in names:
        visit(name)
    return order


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _admits(spec: str, version: str) -> bool:
    v = _version_tuple(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.match(r"(>=|<=|==|<|>|!=)\s*([\d.]+)$", clause)
        if not m:
            return False
        op, bound = m[1], _version_tuple(m[2])
        bound = bound + (0,) * (len(v) - len(bound))
        ok = {">=": v >= bound, "<=": v <= bound, "<": v < bound, ">": v > bound, "==": v == bound, "!=": v != bound}[op]
        if not ok:
            return False
    return True


_REQ = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*([^;]*)")


def check(root: Path = ROOT) -> list[str]:
    data, members = load(root)
    problems: list[str] = []
    by_dist = {m.distribution: m for m in members.values()}
    for m in members.values():
        where = f"{m.path.relative_to(root)}/pyproject.toml"
        pyproject = m.path / "pyproject.toml"
        if not pyproject.exists():
            problems.append(f"{where}: missing")
            continue
        proj = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        p = proj.get("project", {})
        if p.get("name") != m.distribution:
            problems.append(f"{where}: name is {p.get('name')!r}, workspace.toml says {m.distribution!r}")
        if p.get("version") != m.version:
            problems.append(f"{where}: version is {p.get('version')!r}, workspace.toml says {m.version!r}; "
                            f"change one of them so they agree")
        if proj.get("build-system", {}).get("build-backend") != "hatchling.build":
            problems.append(f"{where}: build-backend must be hatchling.build (one backend for all planes)")
        internal: dict[str, str] = {}
        torch_spec = None
        for req in p.get("dependencies", []):
            mm = _REQ.match(req)
            if not mm:
                continue
            name, spec = mm[1].lower().replace("_", "-"), mm[3].strip()
            if name in by_dist:
                internal[by_dist[name].name] = spec
            if name == "torch":
                torch_spec = spec
        for dep, spec in m.depends.items():
            if dep not in internal:
                problems.append(f"{where}: missing internal dependency {members[dep].distribution}{spec}")
            elif internal[dep].replace(" ", "") != spec.replace(" ", ""):
                problems.append(f"{where}: {members[dep].distribution}{internal[dep]} disagrees with "
                                f"workspace.toml's {spec}")
        for dep in internal:
            if dep not in m.depends:
                problems.append(f"{where}: depends on {members[dep].distribution}, which workspace.toml does not "
                                f"list for {m.name} (add the edge there if the graph allows it)")
        if m.torch and torch_spec is None:
            problems.append(f"{where}: a torch plane must depend on {data['workspace']['torch-range']}")
        if not m.torch and torch_spec is not None:
            problems.append(f"{where}: {m.name} is torch-free in workspace.toml but depends on torch")
        if m.name == "kernel" and not any((_REQ.match(r) or [None, ""])[1].lower() == "numpy"
                                          for r in p.get("dependencies", [])):
            problems.append(f"{where}: plyx-kernel must depend on numpy (torch warns on every import without it)")
        if torch_spec is not None and "==" in torch_spec:
            problems.append(f"{where}: torch is pinned ({torch_spec}); declare a range, the matrix holds the pin")
        if m.name != "specs":
            eps = p.get("entry-points", {}).get("plyx", {})
            if eps.get(m.name) != f"plyx.{m.name}._plugin":
                problems.append(f"{where}: entry point `plyx.{m.name}` must be `plyx.{m.name}._plugin` in group plyx")
        for dep, spec in m.depends.items():
            if members[dep].layer >= m.layer:
                problems.append(f"workspace.toml: {m.name} (layer {m.layer}) depends on {dep} (layer "
                                f"{members[dep].layer}): nothing may depend upward or sideways")
            if not _admits(spec, members[dep].version):
                problems.append(f"workspace.toml: {m.name} requires {dep}{spec}, which excludes its version "
                                f"{members[dep].version}")
    problems += check_namespace(root)
    problems += check_imports(root, members)
    return problems


def check_namespace(root: Path = ROOT) -> list[str]:
    """No ``plyx/__init__.py`` anywhere: one stray file shadows every other plane."""
    skip = {".venv", ".nox", "node_modules", ".git"}
    return [
        f"{path.relative_to(root)}: plyx is a PEP 420 namespace; delete this file"
        for path in root.rglob("plyx/__init__.py")
        if not skip.intersection(path.relative_to(root).parts)
    ]


def check_imports(root: Path, members: dict[str, Member]) -> list[str]:
    """Static scan: a plane's sources import only itself and the planes it declares.

    Transitive dependencies do not count: a plane that needs plyx.kernel declares it.
    """
    problems = []
    for m in members.values():
        allowed = {m.name, *m.depends}
        for path in sorted((m.path / "src").rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except SyntaxError as exc:
                problems.append(f"{path.relative_to(root)}: {exc}")
                continue
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "plyx" and len(parts) > 1 and parts[1] in members and parts[1] not in allowed:
                        problems.append(f"{path.relative_to(root)}:{node.lineno}: imports plyx.{parts[1]}, "
                                        f"which {m.distribution} does not depend on")
    return problems


#: where `wheels` writes by default, relative to the checkout (git-ignored: /dist/)
WHEELHOUSE = "dist/wheelhouse"


def _wheel_command(out: str, sources: list[str]) -> list[list[str]]:
    """``pip wheel`` of this interpreter (one call), else ``uv build`` per plane (uv-made venvs have no pip).

    Where hatchling is importable here the builds skip pip's isolated build
    environments (seconds per plane on a small machine).
    """
    import importlib.util

    if importlib.util.find_spec("pip") is not None:
        isolation = ["--no-build-isolation"] if importlib.util.find_spec("hatchling") is not None else []
        return [[sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "--wheel-dir", out, *sources]]
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("workspace.py wheels: needs pip in this Python (python -m ensurepip) or uv on PATH")
    return [[uv, "build", "-q", "--wheel", "--out-dir", out, source] for source in sources]


def build_wheels(out: Path, planes: list[str] | None = None, root: Path = ROOT) -> list[Path]:
    """Build a wheel of every plane (or of ``planes`` and their dependencies) into ``out``.

    Wheels are built in a temporary directory and moved into ``out`` only when
    every build succeeded, replacing older wheels of the same distributions, so
    an interrupted or failed run leaves the wheelhouse as it was.

    Returns:
        the wheels written, one per plane, dependencies first.
    """
    _, members = load(root)
    unknown = [p for p in planes or [] if p not in members]
    if unknown:
        raise SystemExit(f"workspace.py wheels: unknown plane(s) {', '.join(unknown)} (planes: {', '.join(members)})")
    names = closure(members, planes) if planes else list(members)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=out) as tmp:
        print("building " + ", ".join(f"{members[n].distribution} {members[n].version}" for n in names), flush=True)
        for cmd in _wheel_command(tmp, [str(members[n].path) for n in names]):
            subprocess.run(cmd, check=True)
        for wheel in sorted(Path(tmp).glob("*.whl")):
            dist = wheel.name.split("-")[0]
            for stale in out.glob(f"{dist}-*.whl"):
                stale.unlink()
            target = out / wheel.name
            shutil.move(str(wheel), target)
            written.append(target)
    order = {members[n].distribution.replace("-", "_"): i for i, n in enumerate(names)}
    return sorted(written, key=lambda w: order.get(w.name.split("-")[0], len(order)))


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "check"
    if cmd == "wheels":
        parser = argparse.ArgumentParser(prog="workspace.py wheels", description="build a wheelhouse of the planes")
        parser.add_argument("planes", nargs="*", help="only these planes and their plyx dependencies")
        parser.add_argument("--out", default=str(ROOT / WHEELHOUSE), help=f"wheelhouse (default {WHEELHOUSE})")
        args = parser.parse_args(argv[2:])
        wheels = build_wheels(Path(args.out), args.planes or None)
        out = Path(args.out)
        shown = out.relative_to(Path.cwd()) if out.resolve().is_relative_to(Path.cwd()) else out
        print(f"{len(wheels)} wheel(s) in {shown}; install a plane with exactly its plyx dependencies:")
        print(f"    pip install --find-links {shown} plyx-serve")
        return 0
    if cmd == "check":
        problems = check()
        for p in problems:
            print(p)
        print("workspace: ok" if not problems else f"workspace: {len(problems)} problem(s)")
        return 1 if problems else 0
    if cmd == "members":
        _, members = load()
        for m in members.values():
            print(m.name, m.distribution, m.version, "torch" if m.torch else "no-torch")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
