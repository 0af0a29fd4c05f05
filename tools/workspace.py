"""Read ``workspace.toml`` and check that every plane agrees with it.

    python tools/workspace.py check      # exit 1 naming every disagreement
    python tools/workspace.py members    # one line per plane (used by scripts)

Checks:
- each member's pyproject: distribution name, version, internal dependency
  ranges exactly as declared, no internal dependency that is not declared,
  torch declared as a range (never pinned) exactly when ``torch = true``,
  hatchling as the build backend, the ``plyx`` entry point of its plugin;
- the graph: every edge points to a lower ``layer`` (nothing imports upward)
  and every declared range admits the dependency's current version;
- sources: no ``plyx/__init__.py`` in any distribution (PEP 420), and no
  ``import plyx.X`` of a plane the importer does not depend on.
"""

from __future__ import annotations

import ast
import re
import sys
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


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "check"
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
