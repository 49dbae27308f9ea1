import json
import os

import pytest

from optimum_memopt.memory_config import (
    MemoryOptEntry,
    parse_entries,
    parse_memory_opt_config,
    read_json_file,
    to_inline,
    write_json_file,
)

# (value, exact message)
BAD_INLINE = [
    ("BiasGelu+:3:-1", "`--memory_opt_config` entry 'BiasGelu+:3:-1' has optimization type 3; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'BiasGelu+:1:-1'"),
    ("BiasGelu+:-1:-1", "`--memory_opt_config` entry 'BiasGelu+:-1:-1' has optimization type -1; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'BiasGelu+:1:-1'"),
    ("BiasGelu+:x:-1", "`--memory_opt_config` entry 'BiasGelu+:x:-1' has optimization type 'x', not an integer; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'BiasGelu+:1:-1'"),
    ("BiasGelu+:1.0:-1", "`--memory_opt_config` entry 'BiasGelu+:1.0:-1' has optimization type '1.0', not an integer; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'BiasGelu+:1:-1'"),
    ("BiasGelu+:1:0", "`--memory_opt_config` entry 'BiasGelu+:1:0' has apply count 0; expected -1 (all occurrences) or a positive integer, as in 'BiasGelu+:1:-1' or 'BiasGelu+:1:2'"),
    ("BiasGelu+:1:-2", "`--memory_opt_config` entry 'BiasGelu+:1:-2' has apply count -2; expected -1 (all occurrences) or a positive integer, as in 'BiasGelu+:1:-1' or 'BiasGelu+:1:2'"),
    ("BiasGelu+:1:all", "`--memory_opt_config` entry 'BiasGelu+:1:all' has apply count 'all', not an integer; expected -1 (all occurrences) or a positive integer, as in 'BiasGelu+:1:-1' or 'BiasGelu+:1:2'"),
    ("BiasGelu+:1:", "`--memory_opt_config` entry 'BiasGelu+:1:' has apply count '', not an integer; expected -1 (all occurrences) or a positive integer, as in 'BiasGelu+:1:-1' or 'BiasGelu+:1:2'"),
    ("BiasGelu", "`--memory_opt_config` entry 'BiasGelu' has 1 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'BiasGelu+:1:-1'"),
    ("BiasGelu+:1", "`--memory_opt_config` entry 'BiasGelu+:1' has 2 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'BiasGelu+:1:-1'"),
    ("BiasGelu+:1:-1:5", "`--memory_opt_config` entry 'BiasGelu+:1:-1:5' has 4 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'BiasGelu+:1:-1'"),
    ("BiasGelu:1:-1", "`--memory_opt_config` entry 'BiasGelu:1:-1' has subgraph 'BiasGelu' that does not end with '+'; expected a sequence of 'OpName+' parts such as 'BiasGelu+' or 'Reshape+Where+BiasSoftmax+', as in 'BiasGelu+:1:-1'"),
    ("Bias-Gelu+:1:-1", "`--memory_opt_config` entry 'Bias-Gelu+:1:-1' has subgraph 'Bias-Gelu+' that has an invalid part 'Bias-'; expected a sequence of 'OpName+' parts such as 'BiasGelu+' or 'Reshape+Where+BiasSoftmax+', as in 'BiasGelu+:1:-1'"),
    ("Reshape++Where+:1:-1", "`--memory_opt_config` entry 'Reshape++Where+:1:-1' has subgraph 'Reshape++Where+' that has an invalid part '+'; expected a sequence of 'OpName+' parts such as 'BiasGelu+' or 'Reshape+Where+BiasSoftmax+', as in 'BiasGelu+:1:-1'"),
    ("+:1:-1", "`--memory_opt_config` entry '+:1:-1' has subgraph '+' that has an invalid part '+'; expected a sequence of 'OpName+' parts such as 'BiasGelu+' or 'Reshape+Where+BiasSoftmax+', as in 'BiasGelu+:1:-1'"),
    (":1:-1", "`--memory_opt_config` entry ':1:-1' has an empty subgraph; expected a sequence of 'OpName+' parts, as in 'BiasGelu+:1:-1'"),
    ("BiasGelu+:1:-1,,Cast+:2:-1", "`--memory_opt_config` value 'BiasGelu+:1:-1,,Cast+:2:-1' has an empty entry at position 2; separate plans with single commas, as in 'BiasGelu+:1:-1,Cast+:2:-1'"),
    ("BiasGelu+:1:-1,", "`--memory_opt_config` value 'BiasGelu+:1:-1,' has an empty entry at position 2; separate plans with single commas, as in 'BiasGelu+:1:-1,Cast+:2:-1'"),
    (",BiasGelu+:1:-1", "`--memory_opt_config` value ',BiasGelu+:1:-1' has an empty entry at position 1; separate plans with single commas, as in 'BiasGelu+:1:-1,Cast+:2:-1'"),
    ("BiasGelu+:1:-1,BiasGelu+:2:-1", "`--memory_opt_config` names subgraph 'BiasGelu+' twice ('BiasGelu+:1:-1' and 'BiasGelu+:2:-1'); give each subgraph once, as in 'BiasGelu+:1:-1,Cast+:2:-1'"),
    ("Cast+:1:-1,BiasGelu+:1:-1,Cast+:1:-1", "`--memory_opt_config` names subgraph 'Cast+' twice ('Cast+:1:-1' and 'Cast+:1:-1'); give each subgraph once, as in 'BiasGelu+:1:-1,Cast+:2:-1'"),
    ("BiasGelu+;1;-1", "`--memory_opt_config` entry 'BiasGelu+;1;-1' has 1 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'BiasGelu+:1:-1'"),
]


@pytest.mark.parametrize("value,message", BAD_INLINE, ids=[v for v, _ in BAD_INLINE])
def test_bad_inline_values(value, message):
    with pytest.raises(ValueError) as info:
        parse_memory_opt_config(value)
    assert str(info.value) == message


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_FILES = [
    ("not_a_list.json", '{"BiasGelu+": 1}', "holds a JSON dict, not a list; expected a list of plans"),
    ("string.json", '"BiasGelu+:1:-1"', "holds a JSON str, not a list"),
    ("empty_list.json", "[]", "holds an empty list; list at least one plan"),
    ("number_item.json", '["BiasGelu+:1:-1", 3]', "item 1 is 3 (int), not a string"),
    ("nested.json", '[["BiasGelu+:1:-1"]]', "item 0 is ['BiasGelu+:1:-1'] (list), not a string"),
    ("empty_item.json", '["  "]', "item 0 is an empty string"),
    ("bad_json.json", '["BiasGelu+:1:-1",', "is not valid JSON"),
    ("bad_entry.json", '["BiasGelu+:5:-1"]', "entry 'BiasGelu+:5:-1' in file"),
    ("dup.json", '["Cast+:1:-1", "Cast+:2:-1"]', "names subgraph 'Cast+' twice in file"),
]


@pytest.mark.parametrize("name,text,fragment", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_json_files(tmp_path, name, text, fragment):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError) as info:
        parse_memory_opt_config(path)
    msg = str(info.value)
    assert msg.startswith("`--memory_opt_config`")
    assert fragment in msg
    assert path in msg


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match=r"^`--memory_opt_config` file '.*nope.json' does not exist; give an existing JSON file"):
        parse_memory_opt_config(path)


def test_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"is a directory; expected a JSON file"):
        parse_memory_opt_config(str(tmp_path) + os.sep)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = _write(tmp_path, "locked.json", '["BiasGelu+:1:-1"]')
    os.chmod(path, 0)
    with pytest.raises(ValueError, match="cannot be read"):
        parse_memory_opt_config(path)


def test_undecodable_file(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00[")
    with pytest.raises(ValueError, match="cannot be read"):
        parse_memory_opt_config(str(path))


@pytest.mark.parametrize("value", [None, "", "   "])
def test_empty_means_off(value):
    assert parse_memory_opt_config(value) == []


def test_good_inline_values():
    entries = parse_memory_opt_config(" BiasGelu+:1:-1 , Reshape+Where+BiasSoftmax+:2:3,Cast+:0:-1")
    assert entries == [
        MemoryOptEntry("BiasGelu+", 1, -1),
        MemoryOptEntry("Reshape+Where+BiasSoftmax+", 2, 3),
        MemoryOptEntry("Cast+", 0, -1),
    ]
    assert [e.enabled for e in entries] == [True, True, False]


@pytest.mark.parametrize(
    "text",
    ["BiasGelu+:1:-1", "BiasGelu+:1:-1,Cast+:2:-1", "Reshape+Unsqueeze+Unsqueeze+Cast+Sub+Mul+Cast+:1:4,FusedMatMul+:1:-1"],
)
def test_round_trip_string_entries_json_entries(tmp_path, text):
    entries = parse_entries(text)
    assert to_inline(entries) == text
    path = write_json_file(entries, str(tmp_path / "plans.json"))
    with open(path) as f:
        on_disk = json.load(f)
    # exactly what ORT 1.19 reads: a JSON list of plan strings
    assert on_disk == text.split(",")
    assert read_json_file(path) == entries
    assert parse_memory_opt_config(path) == entries


def test_list_input():
    assert parse_memory_opt_config(["BiasGelu+:1:-1", "Cast+:2:-1"]) == parse_entries("BiasGelu+:1:-1,Cast+:2:-1")
