"""`dflash bench` with typed answers: a prompts-file line's json_schema / regex / choices
constrains that prompt in every method that can, each results row counts its `valid` outputs
beside `prompts`, and transformers' methods, which cannot constrain, are refused up front;
llama.cpp's constrained decoding of the same prompts on a real llama-server."""

import json
import os

import pytest

from dflash.bench import llamacpp
from dflash.bench.run import count_valid, run_bench, valid_answer
from dflash.errors import DFlashError

LINES = [
    {"prompt": "Is the ticket urgent? Answer as JSON.", "json_schema": {
        "type": "object", "properties": {"urgent": {"type": "boolean"}, "team": {"enum": ["billing", "support"]}},
        "required": ["urgent", "team"], "additionalProperties": False}},
    {"prompt": "When was the invoice sent?", "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"},
    {"prompt": "Label: my card was charged twice.", "choices": ["billing", "technical issue", "other"]},
    {"prompt": "Say hello."},
]


def prompts_file(tmp_path, lines=LINES):
    path = tmp_path / "typed.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_valid_answers_parse_and_validate(tiny_text_engine):
    schema = LINES[0]["json_schema"]
    assert valid_answer('{"urgent": true, "team": "billing"}', {"json_schema": schema})
    assert not valid_answer('{"urgent": "yes", "team": "billing"}', {"json_schema": schema})
    assert not valid_answer('{"urgent": true, "team": "bill', {"json_schema": schema})  # cut short
    assert valid_answer('{\n  "urgent": true,\n  "team": "billing"\n}', {"json_schema": schema})  # llama.cpp's
    date = {"regex": LINES[1]["regex"]}
    assert valid_answer("2026-12-06", date, tiny_text_engine)
    assert not valid_answer("2026-12-06 ", date, tiny_text_engine)  # the whole text
    assert not valid_answer("2026-12-0", date, tiny_text_engine)  # cut short
    # the grammar library's regex syntax (Rust's), which Python's re does not read
    assert valid_answer("Ada", {"regex": r"\p{Lu}[a-z]+"}, tiny_text_engine)
    assert not valid_answer("ada", {"regex": r"\p{Lu}[a-z]+"}, tiny_text_engine)
    assert valid_answer("abc", {"regex": "[[:alpha:]]+"}, tiny_text_engine)
    assert valid_answer("other", {"choices": ["billing", "other"]}) and not valid_answer("Other", {"choices": ["other"]})
    assert count_valid(["x", "other", "2026-12-06"], [{}, {"choices": ["other"]}, date], tiny_text_engine) == 2
    assert count_valid(["x"], [{}]) is None


def test_the_bench_constrains_each_prompt_and_counts_valid_outputs(tiny_text_engine, tmp_path):
    report = run_bench(tiny_text_engine, [], ["ar", "dflash-4", "dflash-auto"], None, 40,
                       prompt_files=[prompts_file(tmp_path)])
    rows = {r["method"]: r for r in report["results"]}
    for method, row in rows.items():
        assert row["prompts"] == 4 and row["valid"] == 3, (method, row["valid"])
        assert list(row)[list(row).index("prompts") + 1] == "valid"
        assert row["greedy_mismatches"] == 0, method  # `ar` is constrained plain decoding
    assert rows["dflash-auto"]["proposers"]["forced"]["accepted"] > 0
    # The report shows them beside each method's seconds per answer (whitespace a grammar
    # leaves free changes the number of tokens, not the values).
    from dflash.bench.run import markdown

    lines = [ln for ln in markdown(report).splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    auto = [c.strip() for c in next(ln for ln in lines if "| dflash-auto |" in ln).strip("|").split("|")]
    assert head[2:5] == ["prompts", "valid", "s / answer"] and len(auto) == len(head)
    assert auto[3] == "3" and float(auto[4]) == pytest.approx(rows["dflash-auto"]["wall_s"] / 4, abs=0.006)
    # and which proposers it had, with what each drafted and had kept
    forced = rows["dflash-auto"]["proposers"]["forced"]
    assert f"| typed | dflash-auto | forced | {forced['steps']} | {forced['drafted']} | {forced['accepted']} |" in lines


def test_methods_that_cannot_constrain_are_refused(tiny_text_engine, tmp_path):
    with pytest.raises(DFlashError) as err:
        run_bench(tiny_text_engine, [], ["ar", "ar-hf"], None, 4, prompt_files=[prompts_file(tmp_path)])
    assert err.value.code == "bad_method" and "ar-hf" in err.value.message


def test_a_bad_constraint_in_a_prompts_file_names_its_line(tmp_path):
    from dflash.suites import load_prompt_items

    path = prompts_file(tmp_path, [{"prompt": "a"}, {"prompt": "b", "regex": "(x"}])
    with pytest.raises(DFlashError) as err:
        load_prompt_items(path)
    assert err.value.code == "bad_prompts" and ":2:" in err.value.message and "unclosed" in err.value.message
    # a constraint given as null is none (it would otherwise reach the count of valid answers)
    path = prompts_file(tmp_path, [{"prompt": "a", "json_schema": None}, {"prompt": "b", "choices": None}])
    assert load_prompt_items(path) == [{"prompt": "a"}, {"prompt": "b"}]


def test_the_extraction_suite_carries_its_constraints():
    from dflash.suites import load_suite, load_suite_items

    items = load_suite_items("extraction")
    assert len(items) >= 30 and all(len(i) == 2 for i in items)
    assert load_suite("extraction") == [i["prompt"] for i in items]


def test_llama_servers_grammars_for_choices_and_a_regex():
    assert llamacpp.constrained({}) == {}
    assert llamacpp.constrained({"json_schema": {"type": "boolean"}}) == {"json_schema": {"type": "boolean"}}
    assert llamacpp.constrained({"choices": ['a "b"', "c\\d"]}) == {"grammar": 'root ::= "a \\"b\\"" | "c\\\\d"'}
    regex = llamacpp.constrained({"regex": "[0-9]{2}-x"})["grammar"]
    assert regex.startswith("root ::= (root-1 root-1 \"-\" \"x\")") and "root-1 ::= [0-9]" in regex


@pytest.mark.slow
def test_llamacpp_constrains_the_same_prompts(tmp_path):
    """llama.cpp's own constrained decoding (llama-server's json_schema, GBNF) of the typed
    prompts on SmolLM2's GGUF, beside ours: every answer of both valid."""
    from dflash.cli import main
    from dflash.model_files import default_target_gguf

    if not llamacpp.binary("llama-server").is_file():
        if os.environ.get("CI"):
            pytest.fail("llama-server is not built (make peers)")
        pytest.skip("llama-server is not built (make peers)")
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(default_target_gguf()), "--target-backend", "hf", "--threads", "2",
                 "--suites", "", "--prompts", str(prompts_file(tmp_path, LINES[:3])), "--max-new-tokens", "48",
                 "--methods", "ar,dflash-auto,llamacpp-ar-gguf", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert {m: r["valid"] for m, r in rows.items()} == {"ar": 3, "dflash-auto": 3, "llamacpp-ar-gguf": 3}
