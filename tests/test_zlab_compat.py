"""The engine must reproduce the reference DFlash implementation (z-lab/dflash @ 44947fb)
on SmolLM2-135M-Instruct: see ../shared/fixtures/zlab-compat/README.md."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash.loading import load_drafter
from dflash.engine.engine import GenerationRequest


@pytest.fixture(scope="module")
def golden(shared):
    return json.loads((shared / "fixtures/zlab-compat/golden.json").read_text())


def test_single_forward_matches_reference(shared, smol_target):
    """One drafter forward with no cache, fp32: within 1e-4 relative error."""
    drafter = load_drafter(shared / "fixtures/zlab-compat/drafter")
    f = load_file(str(shared / "fixtures/zlab-compat/forward.safetensors"))
    with torch.inference_mode():
        out = drafter(f["target_hidden"].float(), smol_target.embed(f["noise_ids"]), f["position_ids"][0])
    expected = f["expected_hidden"].float()
    rel = ((out - expected).norm() / expected.norm()).item()
    assert rel < 1e-4, rel


def test_prompts_tokenize_like_the_reference(golden, zlab_engine):
    for rec in golden["records"]:
        ids = zlab_engine.prompt_ids(GenerationRequest(prompt=rec["text"], chat=rec["kind"] == "chat"))
        assert ids == rec["input_ids"], rec["text"]


# The record test_reference_extra_step_also_matches runs one token further: the one whose
# drafts vary most from step to step.
EXTRA = 2


@pytest.fixture(scope="module")
def batched(golden, zlab_engine):
    """Every record, and record EXTRA once more with one token more, in one batched run (one
    target forward per step for all of them): each must still be exactly its reference, step
    by step."""
    recs = golden["records"]
    return zlab_engine.generate_many([
        GenerationRequest(input_ids=rec["input_ids"], block_size=rec["block_size"],
                          max_new_tokens=rec["max_new_tokens"] + extra)
        for rec, extra in [(rec, 0) for rec in recs] + [(recs[EXTRA], 1)]])


def test_every_step_and_output_match_reference(golden, zlab_engine, batched):
    assert golden["stop_token_ids"] == zlab_engine.target.eos_ids
    for rec, res in zip(golden["records"], batched[:-1], strict=True):
        where = f"{rec['kind']} prompt {rec['text']!r}, block {rec['block_size']}"
        assert res.prompt_ids + res.output_ids == rec["output_ids"], where
        assert rec["output_ids"] == rec["hf_greedy_ids"]
        ours = [s.draft_ids for s in res.stats.steps]
        # The reference runs one extra step after the last needed token (it loops while
        # start < max_len and truncates afterwards); we stop as soon as max_new_tokens are
        # committed, so we have every reference step but that last one.
        assert len(ours) == len(rec["drafts"]) - 1, where
        for i, (mine, ref) in enumerate(zip(ours, rec["drafts"])):
            assert mine == ref, f"{where}: step {i} drafted {mine}, reference {ref}"


def test_reference_extra_step_also_matches(golden, batched):
    """Run one token further so the reference's final step is compared too."""
    rec = golden["records"][EXTRA]
    assert [s.draft_ids for s in batched[-1].stats.steps][: len(rec["drafts"])] == rec["drafts"]
