import json
import os

import pytest

from optimum_memopt.backends.ort import ConfigFiles
from optimum_memopt.config import MemoryOptConfig
from optimum_memopt.plans import (
    FoundPlan,
    PlanEntry,
    PlanError,
    PlanReport,
    Unmatched,
    match_requests,
    parse_cluster_id,
    parse_entry,
    parse_inline,
    read_json_file,
    to_inline,
)


def parse_memory_opt_config(value):
    """What a user's `--memory_opt_config` value becomes: the config's entries (messages name the flag)."""
    return MemoryOptConfig(plans=value).entries


MemoryOptEntry = PlanEntry
parse_entries = parse_inline

# (value, exact message)
BAD_INLINE = [
    (
        "BiasGelu+:3:-1",
        "`--memory_opt_config` entry 'BiasGelu+:3:-1' has optimization type 3; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu+:-1:-1",
        "`--memory_opt_config` entry 'BiasGelu+:-1:-1' has optimization type -1; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu+:x:-1",
        "`--memory_opt_config` entry 'BiasGelu+:x:-1' has optimization type 'x', not an integer; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu+:1.0:-1",
        "`--memory_opt_config` entry 'BiasGelu+:1.0:-1' has optimization type '1.0', not an integer; expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu+:1:0",
        "`--memory_opt_config` entry 'BiasGelu+:1:0' has apply count 0; expected -1 (all occurrences) or a positive integer, as in 'Gelu+:1:-1' or 'Gelu+:1:2'",
    ),
    (
        "BiasGelu+:1:-2",
        "`--memory_opt_config` entry 'BiasGelu+:1:-2' has apply count -2; expected -1 (all occurrences) or a positive integer, as in 'Gelu+:1:-1' or 'Gelu+:1:2'",
    ),
    (
        "BiasGelu+:1:all",
        "`--memory_opt_config` entry 'BiasGelu+:1:all' has apply count 'all', not an integer; expected -1 (all occurrences) or a positive integer, as in 'Gelu+:1:-1' or 'Gelu+:1:2'",
    ),
    (
        "BiasGelu+:1:",
        "`--memory_opt_config` entry 'BiasGelu+:1:' has apply count '', not an integer; expected -1 (all occurrences) or a positive integer, as in 'Gelu+:1:-1' or 'Gelu+:1:2'",
    ),
    (
        "BiasGelu",
        "`--memory_opt_config` entry 'BiasGelu' has 1 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu+:1",
        "`--memory_opt_config` entry 'BiasGelu+:1' has 2 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu+:1:-1:5",
        "`--memory_opt_config` entry 'BiasGelu+:1:-1:5' has 4 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu:1:-1",
        "`--memory_opt_config` entry 'BiasGelu:1:-1' has subgraph 'BiasGelu' that does not end with '+'; expected a sequence of 'OpName+' parts such as 'Gelu+' or 'Reshape+Where+BiasSoftmax+', as in 'Gelu+:1:-1'",
    ),
    (
        "Bias-Gelu+:1:-1",
        "`--memory_opt_config` entry 'Bias-Gelu+:1:-1' has subgraph 'Bias-Gelu+' that has an invalid part 'Bias-'; expected a sequence of 'OpName+' parts such as 'Gelu+' or 'Reshape+Where+BiasSoftmax+', as in 'Gelu+:1:-1'",
    ),
    (
        "Reshape++Where+:1:-1",
        "`--memory_opt_config` entry 'Reshape++Where+:1:-1' has subgraph 'Reshape++Where+' that has an invalid part '+'; expected a sequence of 'OpName+' parts such as 'Gelu+' or 'Reshape+Where+BiasSoftmax+', as in 'Gelu+:1:-1'",
    ),
    (
        "+:1:-1",
        "`--memory_opt_config` entry '+:1:-1' has subgraph '+' that has an invalid part '+'; expected a sequence of 'OpName+' parts such as 'Gelu+' or 'Reshape+Where+BiasSoftmax+', as in 'Gelu+:1:-1'",
    ),
    (
        ":1:-1",
        "`--memory_opt_config` entry ':1:-1' has an empty subgraph; expected a sequence of 'OpName+' parts, as in 'Gelu+:1:-1'",
    ),
    (
        "BiasGelu+:1:-1,,Cast+:2:-1",
        "`--memory_opt_config` value 'BiasGelu+:1:-1,,Cast+:2:-1' has an empty entry at position 2; separate plans with single commas, as in 'Gelu+:1:-1,Cast+:2:-1'",
    ),
    (
        "BiasGelu+:1:-1,",
        "`--memory_opt_config` value 'BiasGelu+:1:-1,' has an empty entry at position 2; separate plans with single commas, as in 'Gelu+:1:-1,Cast+:2:-1'",
    ),
    (
        ",BiasGelu+:1:-1",
        "`--memory_opt_config` value ',BiasGelu+:1:-1' has an empty entry at position 1; separate plans with single commas, as in 'Gelu+:1:-1,Cast+:2:-1'",
    ),
    (
        "BiasGelu+:1:-1,BiasGelu+:2:-1",
        "`--memory_opt_config` names subgraph 'BiasGelu+' twice ('BiasGelu+:1:-1' and 'BiasGelu+:2:-1'); give each subgraph once, as in 'Gelu+:1:-1,Cast+:2:-1', or on layers that do not overlap, as in 'BiasGelu+:1:-1@0-1,BiasGelu+:1:-1@2-3'",
    ),
    (
        "Cast+:1:-1,BiasGelu+:1:-1,Cast+:1:-1",
        "`--memory_opt_config` names subgraph 'Cast+' twice ('Cast+:1:-1' and 'Cast+:1:-1'); give each subgraph once, as in 'Gelu+:1:-1,Cast+:2:-1', or on layers that do not overlap, as in 'Cast+:1:-1@0-1,Cast+:1:-1@2-3'",
    ),
    (
        "BiasGelu+;1;-1",
        "`--memory_opt_config` entry 'BiasGelu+;1;-1' has 1 ':'-separated field(s); expected 3, SubgraphStr:OptimizationType:RequestApplyCount, as in 'Gelu+:1:-1'",
    ),
]


BAD_INLINE += [
    (
        "Gelu+:1:2@1",
        "`--memory_opt_config` entry 'Gelu+:1:2@1' gives both a count (2) and layers (@1); give one, as in 'Gelu+:1:-1@1' or 'Gelu+:1:2'",
    ),
    (
        "Gelu+:1:-1@3-1",
        "`--memory_opt_config` entry 'Gelu+:1:-1@3-1' has layer selector '3-1' with item '3-1'; expected layer numbers from 0 (5), ranges (4-11), every k-th layer (every2) joined by '+', as in 'Layer+:1:-1@every2', 'Gelu+:1:-1@4-11' or 'Layer+:1:-1@0+5+9'",
    ),
    (
        "Layer+:1:-1@1++2",
        "`--memory_opt_config` entry 'Layer+:1:-1@1++2' has layer selector '1++2' with an empty item; expected layer numbers from 0 (5), ranges (4-11), every k-th layer (every2) joined by '+', as in 'Layer+:1:-1@every2', 'Gelu+:1:-1@4-11' or 'Layer+:1:-1@0+5+9'",
    ),
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
    ("bad_entry.json", '["BiasGelu+:5:-1"]', "entry 'BiasGelu+:5:-1' has optimization type 5"),
    ("dup.json", '["Cast+:1:-1", "Cast+:2:-1"]', "names subgraph 'Cast+' twice"),
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
    with pytest.raises(
        ValueError, match=r"^`--memory_opt_config` file '.*nope.json' does not exist; give an existing JSON file"
    ):
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
    [
        "BiasGelu+:1:-1",
        "BiasGelu+:1:-1,Cast+:2:-1",
        "Reshape+Unsqueeze+Unsqueeze+Cast+Sub+Mul+Cast+:1:4,FusedMatMul+:1:-1",
    ],
)
def test_round_trip_string_entries_json_entries(tmp_path, text):
    entries = parse_entries(text)
    assert to_inline(entries) == text
    path = ConfigFiles(str(tmp_path / "cfg")).write(entries)
    with open(path) as f:
        on_disk = json.load(f)
    # exactly what ORT 1.19 reads: a JSON list of plan strings
    assert on_disk == text.split(",")
    assert read_json_file(path) == entries
    assert parse_memory_opt_config(path) == entries


def test_list_input():
    assert parse_memory_opt_config(["BiasGelu+:1:-1", "Cast+:2:-1"]) == parse_entries("BiasGelu+:1:-1,Cast+:2:-1")


def test_the_grammar_does_not_name_a_flag():
    with pytest.raises(PlanError) as info:
        parse_inline("Gelu+:3:-1")
    assert str(info.value).startswith("entry 'Gelu+:3:-1' has optimization type 3")
    assert "--" not in str(info.value)


def test_cluster_ids_with_counts_of_zero():
    assert parse_cluster_id("Cast+:1:-1,LayerNormalization+:2:0") == [
        PlanEntry("Cast+", 1, -1),
        PlanEntry("LayerNormalization+", 2, 0),
    ]
    with pytest.raises(PlanError, match="apply count 0"):
        parse_inline("Cast+:1:0")  # a user may not ask for zero occurrences


FOUND = [
    FoundPlan("Gelu+:1:-1", False, 3, 1.0e6),
    FoundPlan("Cast+:1:-1,LayerNormalization+:2:0", False, 6, 5.0e5),
    FoundPlan("FusedMatMul+Add+:1:-1", False, 3, 2.0e6),
]


@pytest.mark.parametrize(
    "requested,closest,similar",
    [
        ("BiasGelu+:1:-1", ["Gelu+:1:-1"], True),  # the fused name on a machine where ORT does not fuse
        ("gelu+:1:-1", ["Gelu+:1:-1"], True),  # the case
        ("Gelu+:2:-1", ["Gelu+:1:-1"], True),  # found with another type
        ("Cast+:2:-1", ["Cast+:1:-1"], True),
        ("Foo+:1:-1", ["Gelu+:1:-1", "Cast+:1:-1", "FusedMatMul+Add+:1:-1"], False),  # nothing close: what was found
    ],
)
def test_unmatched_requests_name_the_closest_plans_found(requested, closest, similar):
    (unmatched,) = match_requests([parse_entry(requested)], FOUND)
    assert unmatched == Unmatched(requested, closest, similar)
    assert requested in unmatched.message("ORT") and repr(closest[0]) in unmatched.message("ORT")


def test_requests_that_match_are_not_reported():
    assert match_requests(parse_inline("Gelu+:1:-1,Cast+:1:2,FusedMatMul+Add+:1:-1"), FOUND) == []
    assert match_requests(parse_inline("Foo+:0:-1"), FOUND) == []  # type 0 asks for nothing


def test_plan_report_round_trip():
    report = PlanReport(
        "ort",
        True,
        0,
        ["Gelu+:1:-1"],
        ["Gelu+:1:-1"],
        [FoundPlan("Gelu+:1:-1", True, 3, 1048576.0, "4096*dim0", 3), FOUND[1]],
        {"dim0": 256},
        [Unmatched("Foo+:1:-1", ["Gelu+:1:-1"], False)],
    )
    again = PlanReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report
    assert again.saving_mb(enabled_only=True) == 1.0
    assert [p.as_request() for p in again.plans] == ["Gelu+:1:-1", "Cast+:1:-1"]


def test_whole_layers_and_layer_selectors_read_and_round_trip():
    entries = parse_entries("Layer+:1:-1@every2,Gelu+:1:-1@ 1-3 + 7,Cast+:1:2")
    assert to_inline(entries) == "Layer+:1:-1@every2,Gelu+:1:-1@1-3+7,Cast+:1:2"
    assert [e.select(8) for e in entries] == [[0, 2, 4, 6], [1, 2, 3, 7], [0, 1]]
    assert parse_entries(to_inline(entries)) == entries
    with pytest.raises(PlanError, match=r"names layer 7, but the model has 6 layers \(0-5\)"):
        entries[1].select(6)


@pytest.mark.parametrize("value", ["Layer+:1:2", "Gelu+:1:-1@0-3", "Loss+:1:-1@chunks4"])
def test_the_ort_backend_refuses_whole_layer_plans_and_selectors(value):
    with pytest.raises(ValueError, match=r"are the torch backend's; ONNX Runtime applies a plan to its first N"):
        MemoryOptConfig(plans=value, backend="ort")
    assert MemoryOptConfig(plans=value, backend="torch").entries == parse_entries(value)


def test_the_head_and_loss_plan_reads_and_round_trips():
    entries = parse_entries("Layer+:1:-1@every2, loss+:1:-1@Chunks8")
    assert to_inline(entries) == "Layer+:1:-1@every2,Loss+:1:-1@chunks8"
    assert parse_entries("Loss+:1:-1")[0] == PlanEntry("Loss+", 1, -1, "")
    assert parse_entries("LOSS+:1:-1@tokens1024")[0].parameter == "tokens1024"
    assert not parse_entries("Loss+:0:-1")[0].enabled


@pytest.mark.parametrize(
    "plans, texts",
    [
        ("Loss+:1:-1", {"loss": ""}),
        ("loss+:1:-1@Chunks8", {"loss": "chunks8"}),
        ("Loss+:1:-1@tokens1024", {"loss": "tokens1024"}),
        ("MLP+:1:-1@tiles4", {"mlp": "tiles4"}),
        ("MLP+:1:2@tiles2", {"mlp": "0-1:tiles2"}),  # a count: its layers
        ("MLP+:1:-1@every2:tiles2,MLP+:1:-1@1", {"mlp": "0+2+4+6:tiles2;1"}),
        ("Layer+:1:-1,Loss+:1:-1@chunks2,MLP+:1:-1@0-3+6", {"loss": "chunks2", "mlp": "0-3+6"}),
    ],
)
def test_a_levers_option_is_data_and_its_plans_read_back_to_it(plans, texts):
    """What a policy holds for a lever is data (`LeverOption`: its layers, its parameter as a word and a number); its
    text and its plans are written at the edges only, and the plans read back to the same option."""
    from optimum_memopt.backends.torch.policy import RecomputePolicy
    from optimum_memopt.plans import LeverOption, lever_named

    levers = RecomputePolicy.from_plans(parse_entries(plans), 0, 8).levers
    assert all(isinstance(o, LeverOption) for o in levers.values())
    assert {name: str(o) for name, o in levers.items()} == texts
    written = ",".join(lever_named(name).plan_of(o) for name, o in levers.items())
    assert RecomputePolicy.from_plans(parse_entries(written), 0, 8).levers == levers


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("Loss+:1:4", "apply count 4; a model has one head, so `Loss+` takes -1"),
        ("Loss+:2:-1", "optimization type 2; `Loss+` is 1 (on) or 0 (off)"),
        ("Loss+:1:-1@4", "chunking '4'; expected 'chunksN' (N chunks) or 'tokensN' (N tokens a chunk)"),
        ("Loss+:1:-1@chunks0", "chunking 'chunks0'"),
        ("Loss+:1:-1@chunks٥", "chunking 'chunks٥', whose digits are not ASCII (0-9)"),
        ("Loss+:1:-1@tokens" + "9" * 5000, "(5006 characters); expected 'chunksN'"),
        ("Loss+:1:-1,loss+:1:-1@chunks2", "names 'Loss+' twice ('Loss+:1:-1' and 'Loss+:1:-1@chunks2'); a model has"),
        ("Gelu+Loss+:1:-1", "names 'Loss+' with other parts: the head and loss are a plan of their own"),
    ],
)
def test_bad_head_and_loss_plans_are_refused_with_the_form_that_works(value, fragment):
    with pytest.raises(PlanError) as e:
        parse_entries(value)
    assert fragment in str(e.value) and "Loss+:1:-1" in str(e.value)
