"""The workspace check catches each way a plane can disagree with workspace.toml."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import workspace  # noqa: E402


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the workspace's declarative files and plane sources."""
    shutil.copy(ROOT / "workspace.toml", tmp_path / "workspace.toml")
    for pyproject in ROOT.glob("packages/*/pyproject.toml"):
        plane = pyproject.parent
        dest = tmp_path / "packages" / plane.name
        shutil.copytree(plane / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(pyproject, dest / "pyproject.toml")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_the_real_workspace_is_consistent():
    assert workspace.check(ROOT) == []


def test_the_copy_is_consistent(tree):
    assert workspace.check(tree) == []


def test_version_disagreement(tree):
    pyproject = tree / "packages/attn/pyproject.toml"
    current = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M).group(1)  # whatever it is today
    _edit(pyproject, f'version = "{current}"', 'version = "9.9.9"')
    problems = workspace.check(tree)
    assert any("packages/attn/pyproject.toml: version is '9.9.9'" in p for p in problems)


def test_internal_range_disagreement(tree):
    pyproject = tree / "packages/model/pyproject.toml"
    attn = re.search(r"'plyx-attn>=([^,']+),<2'", pyproject.read_text())  # whatever its lower bound is today
    _edit(pyproject, attn.group(0), f"'plyx-attn>={attn.group(1)},<3'")
    assert any(f"plyx-attn>={attn.group(1)},<3 disagrees" in p for p in workspace.check(tree))


def test_undeclared_internal_dependency(tree):
    pyproject = tree / "packages/governance/pyproject.toml"
    specs = re.search(r"'plyx-specs>=[^']*'", pyproject.read_text()).group(0)  # whatever its range is today
    _edit(pyproject, specs, f"{specs}, 'plyx-kernel>=1.0,<2'")
    problems = workspace.check(tree)
    assert any("depends on plyx-kernel, which workspace.toml does not list for governance" in p for p in problems)


def test_upward_edge_in_workspace(tree):
    text = (tree / "workspace.toml").read_text()
    attn = re.search(r'\[members\.attn\][^\[]*?(depends = \{[^}]*) \}', text)  # attn's edges, whatever their ranges
    _edit(tree / "workspace.toml", attn.group(1) + " }", attn.group(1) + ', train = ">=1.0,<2" }')
    problems = workspace.check(tree)
    assert any("attn (layer 2) depends on train (layer 4)" in p for p in problems)


def test_torch_pin_and_torch_in_a_torch_free_plane(tree):
    _edit(tree / "packages/kernel/pyproject.toml", "'torch>=2.4'", "'torch==2.13.0'")
    _edit(tree / "packages/safety/pyproject.toml", "dependencies = [", "dependencies = ['torch>=2.4', ")
    problems = workspace.check(tree)
    assert any("torch is pinned" in p for p in problems)
    assert any("safety is torch-free" in p for p in problems)


def test_stray_namespace_init(tree):
    (tree / "packages/serve/src/plyx/__init__.py").write_text("")
    assert any("PEP 420" in p for p in workspace.check(tree))


def test_import_of_an_undeclared_plane(tree):
    target = tree / "packages/governance/src/plyx/governance/_sneaky.py"
    target.write_text("import plyx.train\n")
    problems = workspace.check(tree)
    assert any("_sneaky.py:1: imports plyx.train, which plyx-governance does not depend on" in p for p in problems)


def test_closure_orders_dependencies_first():
    _, members = workspace.load(ROOT)
    order = workspace.closure(members, ["train"])
    assert order.index("specs") < order.index("kernel") < order.index("model") < order.index("train")


def test_plyx_kernel_must_declare_numpy(tree):
    _edit(tree / "packages/kernel/pyproject.toml", ", 'numpy>=1.26'", "")
    assert any("plyx-kernel must depend on numpy" in p for p in workspace.check(tree))


def test_a_wheelhouse_installs_exactly_a_planes_closure(tmp_path):
    """`workspace.py wheels`, then `pip install --find-links <wheelhouse> plyx-serve` in a fresh venv."""
    import json
    import subprocess
    import venv

    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)  # ensurepip: no index needed for pip itself
    python = env_dir / "bin" / "python"
    wheelhouse = tmp_path / "wheelhouse"
    # a wheelhouse holding more than serve's closure (governance is not in it)
    subprocess.run([python, ROOT / "tools" / "workspace.py", "wheels", "--out", wheelhouse, "serve", "governance"],
                   check=True, capture_output=True, text=True, timeout=900)
    built = sorted(w.name.split("-")[0] for w in wheelhouse.glob("*.whl"))
    assert built == ["plyx_attn", "plyx_governance", "plyx_kernel", "plyx_model", "plyx_serve", "plyx_specs"]
    subprocess.run([python, "-m", "pip", "install", "-q", "-c", ROOT / "constraints" / "torch.txt",
                    "--find-links", wheelhouse, "plyx-serve"], check=True, capture_output=True, text=True, timeout=900)
    code = ("import json, importlib.metadata as m; print(json.dumps(sorted(d.metadata['Name'] for d in m.distributions()"
            " if (d.metadata['Name'] or '').startswith('plyx-'))))")
    installed = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)
    _, members = workspace.load(ROOT)
    assert installed == sorted(members[n].distribution for n in workspace.closure(members, ["serve"]))
    # the plane's command is there, another plane's says what to install
    proc = subprocess.run([env_dir / "bin" / "plyx", "train"], capture_output=True, text=True, timeout=300,
                          env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 2 and "`plyx train` is provided by plyx-train, which is not installed" in proc.stderr
