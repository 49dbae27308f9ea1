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


def plan_lines(log):
    """The lines the plugin's trainer and plan said at INFO, in run_clm's log format (a record's continuation lines
    included); the memory phases' line is `--print_memory_stats`'s, and the picture's a file's name."""
    lines, ours = [], False
    for line in log.splitlines():
        record = re.match(r"^\d{4}-\d\d-\d\d [\d:,]+ (\w+) (\S+) - (.*)", line)
        if record:
            level, name, text = record.groups()
            ours = level == "INFO" and name in ("optimum_memopt", "optimum_memopt.trainer")
            ours = ours and not text.startswith("memory phases:")
        elif line.startswith(("{", "[", "*")):
            ours = False
        if ours:
            lines.append(line)
    return lines


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
        kept = "step one ran the dry run's choice and keeps it" in said  # `--memory_auto_dry_run true`
        assert (kept or "the solver chose" in said) and "within the budget" in said, said[-4000:]
        # the plan in at most six lines (what runs, the peaks against the budget, where the step peaks, the file
        # with the rest); the table, its notes and the figures behind the choice in that file
        plan = plan_lines(res.stdout)
        assert len(plan) <= 6 and any("memory_plans.txt" in line for line in plan), "\n".join(plan)
        rest = (out / "memory_plans.txt").read_text()
        assert "STATE  CONFIG" in rest and "later steps hold" in rest and "STATE  CONFIG" not in said
    if "--print_memory_stats" in argv:
        assert (out / "memory_phases.csv").is_file()
