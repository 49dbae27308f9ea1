"""The suite's own parallel run holds what tests/README.md says of it: under `--dist loadgroup` the tests of one xdist
group (the launches, `loopback`; a `one_worker` module's tests, which share a costly module fixture) run on one
worker, one at a time. pytest 9.2 reads a node's id from elsewhere than
where pytest-xdist 3.8 writes the group into it, and the group is then silently lost: the launches ran on both workers
at once, racing for their ports, and each worker built the session's launches again (docs/STACK.md). Checked by a
pytest session of its own, with this environment's pytest and pytest-xdist, on two workers."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

TESTS = textwrap.dedent(
    """
    import os

    import pytest

    @pytest.fixture(autouse=True)
    def where(request):
        yield
        with open(os.path.join(os.path.dirname(__file__), "ran.txt"), "a") as f:
            f.write(f"{request.node.name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

    @pytest.mark.multiprocess
    @pytest.mark.parametrize("i", range(6))
    def test_grouped(i):
        pass

    @pytest.mark.parametrize("i", range(6))
    def test_free(i):
        pass
    """
)
SHARED = textwrap.dedent(
    """
    import os

    import pytest

    pytestmark = pytest.mark.one_worker

    @pytest.fixture(autouse=True)
    def where(request):
        yield
        with open(os.path.join(os.path.dirname(__file__), "ran.txt"), "a") as f:
            f.write(f"{request.node.name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

    @pytest.mark.parametrize("i", range(6))
    def test_shared(i):
        pass
    """
)
HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_group_runs_on_one_worker(tmp_path):
    """The suite's own conftest.py (`-p conftest`) marks the inner session's `multiprocess` tests as it marks the
    launches, and a `one_worker` module's tests by their module."""
    (tmp_path / "test_groups.py").write_text(TESTS)
    (tmp_path / "test_shared.py").write_text(SHARED)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-q", "-n", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])}
    res = subprocess.run(
        [*command, "--dist", "loadgroup", "test_groups.py", "test_shared.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    grouped = {worker for name, worker in ran if name.startswith("test_grouped")}
    shared = {worker for name, worker in ran if name.startswith("test_shared")}
    assert len(ran) == 18 and len(grouped) == len(shared) == 1, (pytest.__version__, sorted(ran))
