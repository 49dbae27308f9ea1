"""The quick-start commands of README.md and the recipes' READMEs, run as written at tiny size (a smaller model,
fewer steps and lines of text, a temporary output directory appended: the last value of a flag wins), so they
cannot rot. A block is a quick start where the line before its fence starts with `<!-- quick start`."""

import os
import re
import shlex
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch_backend]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "examples/run_clm/README.md"]
TINY = {
    "examples/run_clm/run_clm.py": ["--model_size", "tiny", "--max_steps", "4", "--offline_lines", "300",
                                    "--block_size", "64", "--disable_tqdm", "true"],
}  # fmt: skip


def quick_starts(path):
    """The `python ...` commands of the quick-start blocks in `path` (continued lines joined)."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    commands = []
    for block in re.findall(r"<!-- quick start[^\n]*\n```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        commands += [line.split("#")[0].strip() for line in joined.splitlines() if line.startswith("python ")]
    return commands


COMMANDS = [(path, command) for path in DOCS for command in quick_starts(path)]


def test_every_doc_has_its_quick_start():
    assert {path for path, _ in COMMANDS} == set(DOCS)


@pytest.mark.parametrize("path, command", COMMANDS, ids=[f"{p}:{i}" for i, (p, _) in enumerate(COMMANDS)])
def test_a_quick_start_runs_as_written(tmp_path, path, command):
    argv = shlex.split(command)
    script = argv[1]
    if len(argv) == 2:  # the recipe's offline default: what it runs with no arguments
        sys.path.insert(0, os.path.join(ROOT, os.path.dirname(script)))
        argv += __import__(os.path.basename(script)[:-3]).OFFLINE_DEFAULT_ARGS
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(
        [sys.executable, *argv[1:], *TINY[script], "--output_dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    said = res.stdout + res.stderr
    assert res.returncode == 0, said[-4000:]
    if "auto" in argv:  # the choice and its check were said, and the check met the budget
        assert "the solver chose" in said and "within the budget" in said, said[-4000:]
    if "--print_memory_stats" in argv:
        assert (out / "memory_phases.csv").is_file()
