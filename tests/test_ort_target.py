"""The int8 ONNX Runtime target backend (dflash.engine.target.ort): the target exported by
dflash.convert.onnx_target behind the Target protocol. A token's numbers are bit-identical
however it reaches the target (alone, in a verify block, in a prefill chunk, beside another
sequence), rollback equals never having cached the rejected rows, and greedy decoding with
drafts (fixed block sizes and auto, int8 drafter with a draft vocabulary) is exactly the same
backend's plain greedy output. Bad model files are clean errors naming the file."""

import pytest
import torch

from dflash.convert import onnx_q41, onnx_target
from dflash.engine.target import ort
from dflash.engine.target.protocol import TargetRow
from dflash.errors import DFlashError

pytestmark = pytest.mark.skipif(not ort.available() or onnx_target.builder_version() is None,
                                reason="onnxruntime-genai is not installed (make setup)")
LAYERS = (1, 9, 18, 27)  # the default drafter's


@pytest.fixture(scope="module", params=["int8", onnx_q41.PRECISION])
def onnx_file(smol_dir, request):
    """Each build of the export: int8, and q4_1 (the shipped Q4_1 weights exactly, whose 4-bit
    kernels take a lone row through the weights twice: dflash.convert.onnx_q41)."""
    from dflash.model_files import onnx_export_dir

    if request.param == "int8":
        return onnx_target.ensure_export(smol_dir, onnx_export_dir(smol_dir))
    return onnx_q41.ensure_export(smol_dir, onnx_export_dir(smol_dir, request.param), onnx_export_dir(smol_dir))


@pytest.fixture(scope="module")
def ort_target(onnx_file, smol_dir):
    return ort.OrtTarget(onnx_file, smol_dir, threads=2, context=1024)


@pytest.fixture(scope="module")
def ort_engine(ort_target):
    from dflash.engine.engine import Engine
    from dflash.engine import draft_vocab
    from dflash.loading import load_drafter
    from dflash.model_files import default_drafter_dir
    from tests.conftest import cpu_like_costs

    drafter_dir, _ = default_drafter_dir()
    return Engine(ort_target, load_drafter(drafter_dir), "default-drafter", cost_curve=cpu_like_costs(16),
                  draft_dtype="int8", draft_vocab=draft_vocab.for_drafter(drafter_dir))


def _ids(n, offset=0):
    return [(1000 + 37 * i + offset) % 49000 for i in range(n)]


def _module(onnx_file):
    """The converter that made this build."""
    return onnx_q41 if onnx_file.parent.name.endswith(onnx_q41.PRECISION) else onnx_target


def test_the_export_is_edited_for_the_engine(onnx_file, smol_dir):
    import onnxruntime as rt

    from dflash.model_files import onnx_export_dir

    names = {i.name for i in rt.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"]).get_inputs()}
    assert {"seqlens_k", "total_sequence_length", "logit_rows"} <= names and "attention_mask" not in names
    assert _module(onnx_file).is_current(smol_dir, onnx_file.parent)
    if _module(onnx_file) is onnx_target:
        assert onnx_target.ensure_export(smol_dir, onnx_file.parent) == onnx_file  # cached: not exported again
    else:
        assert onnx_q41.ensure_export(smol_dir, onnx_file.parent, onnx_export_dir(smol_dir)) == onnx_file


def test_the_export_is_made_as_its_build_says(onnx_file):
    """Weights in blocks of BLOCK_SIZE (q4_1: the layers' in 4 bits and blocks of 32, each with
    its remainder); the features are the residual nodes' own outputs (no copy per layer); the
    manifest records the build, so a cached price of another build is not reused (it is part
    of the cost curve's key)."""
    import json

    import onnx

    model = onnx.load(str(onnx_file), load_external_data=False)
    blocks = {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
    bits = {n.name: a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    if _module(onnx_file) is onnx_target:
        assert blocks == {onnx_target.BLOCK_SIZE} and set(bits.values()) == {8}
    else:
        assert blocks == {onnx_q41.BLOCK}
        assert {b for name, b in bits.items() if not name.startswith("/lm_head/")} == {4}
        remainders = {n.name for n in model.graph.node if n.name.endswith("/remainder")}
        assert remainders == {f"{name}/remainder" for name, b in bits.items() if b == 4}
    produced = {o for n in model.graph.node for o in n.output}
    assert {f"features.{i}" for i in LAYERS} <= produced
    assert not [n for n in model.graph.node if n.op_type == "Identity"]
    for k in onnx_target.BATCH_GRAPHS:  # the batch graphs: k attention nodes a layer, the same weights file
        batch = onnx.load(str(onnx_file.parent / onnx_target.batch_file(k)), load_external_data=False)
        attention = [n for n in batch.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(attention) == k * len([n for n in model.graph.node if n.op_type == "GroupQueryAttention"])
        files = {e.value for i in batch.graph.initializer for e in i.external_data if e.key == "location"}
        assert files == {onnx_file.name + ".data"}
    manifest = json.loads((onnx_file.parent / onnx_target.MANIFEST).read_text())
    build = _module(onnx_file).BUILD
    assert {k: manifest["key"][k] for k in build} == build
    # The runtime reads what the graph was made as from that manifest (the Target's `build`).
    assert ort.read_build(onnx_file.parent) == build and ort.read_build(onnx_file.parent.parent) is None


def test_the_build_names_the_backend_and_the_fewest_rows_a_call_runs(ort_target, onnx_file):
    """q4_1: a lone row runs as two through the 4-bit weights (min_rows 2), so the cost curve
    prices a plain step as a verify of 2 (dflash.engine.costs)."""
    q41 = _module(onnx_file) is onnx_q41
    assert (ort_target.backend, ort_target.min_rows) == (("ort-q4_1", 2) if q41 else ("ort", 1))


def test_the_borrowed_embedding_and_head_are_read_at_their_first_use(onnx_file, smol_dir):
    """A quantized backend reads the folder's embedding and head only when a drafter or a head
    borrows them (a target served without one never holds them), and then as stored."""
    from dflash.engine.target.hf_files import EMBED, read_tensors

    target = ort.OrtTarget(onnx_file, smol_dir, threads=2, context=64)
    assert "_weights" not in vars(target._side) and target.vocab_size == target._side.head_shape[0]
    stored = read_tensors(smol_dir, (EMBED,))[EMBED]
    assert torch.equal(target.head_weight(), stored) and "_weights" in vars(target._side)  # tied in SmolLM2
    assert torch.equal(target.embed(torch.tensor([5, 9])), stored[[5, 9]])


def test_the_cost_curve_key_names_the_build(ort_engine):
    from dflash.engine.costs import curve_key

    key = curve_key(ort_engine)
    target = ort_engine.target
    saved = target.build
    try:
        target.build = {**target.build, "block_size": 16}
        assert curve_key(ort_engine) != key
    finally:
        target.build = saved


def test_a_token_is_the_same_alone_in_a_block_or_in_a_chunk(ort_target):
    t = ort_target
    prompt, new = _ids(50), _ids(12, 3)
    whole = t.new_sequence()
    ref = t.forward_batch([TargetRow(whole, prompt + new, len(new))], LAYERS)
    t.free(whole)
    for step in (1, 3, 12):
        seq = t.new_sequence()
        t.forward_batch([TargetRow(seq, prompt[:30], 0), TargetRow(t.new_sequence(), _ids(7, 1), 1)], LAYERS)
        t.forward_batch([TargetRow(seq, prompt[30:], 1)], LAYERS)
        logits, feats = [], []
        for k in range(0, len(new), step):
            out = t.forward_batch([TargetRow(seq, new[k : k + step], len(new[k : k + step]))], LAYERS)
            logits.append(out.logits[0])
            feats.append(out.features[0])
        assert torch.equal(torch.cat(logits), ref.logits[0]), f"rows of {step}"
        assert torch.equal(torch.cat(feats), ref.features[0][-len(new):])
        t.free(seq)


def test_a_packed_forward_equals_each_sequence_alone(ort_target):
    t = ort_target
    a, b = t.new_sequence(), t.new_sequence()
    out = t.forward_batch([TargetRow(a, _ids(40), 1), TargetRow(b, _ids(23, 5), 1)], LAYERS)
    assert [x.shape for x in out.logits] == [(1, t.vocab_size)] * 2
    assert out.features[1].shape == (23, 4 * t.hidden_size)
    step = t.forward_batch([TargetRow(a, _ids(5, 9), 5), TargetRow(b, _ids(1, 7), 1)], LAYERS)
    assert (a.length, b.length) == (45, 24)
    for ids, logits in ((_ids(40) + _ids(5, 9), step.logits[0]), (_ids(23, 5) + _ids(1, 7), step.logits[1])):
        alone = t.new_sequence()
        assert torch.equal(t.forward_batch([TargetRow(alone, ids, len(logits))], LAYERS).logits[0], logits)
        t.free(alone)


@pytest.mark.parametrize("n", [3, 5, 9])
def test_several_sequences_run_in_one_call_and_get_what_they_get_alone(ort_target, monkeypatch, n):
    """n sequences at different lengths, with 1, 4 or 30 new rows each, in one forward_batch:
    one ONNX Runtime call per max_batch sequences (3 in the graph for 4, with a stand-in in
    the spare place; 9 as 8 + 1), and each sequence's logits, features and cache exactly as
    when it runs alone."""
    t = ort_target
    assert t.max_batch == max(onnx_target.BATCH_GRAPHS) == 8
    seqs = [t.new_sequence() for _ in range(n)]
    prompts = [_ids(20 + 7 * j, j) for j in range(n)]
    t.forward_batch([TargetRow(s, p, 1) for s, p in zip(seqs, prompts)], LAYERS)
    news = [_ids((1, 4, 30)[j % 3], 50 + j) for j in range(n)]
    calls = []
    for session in [t.session, *(t._batch_session(k) for k in onnx_target.BATCH_GRAPHS)]:
        run = session.run_with_iobinding
        monkeypatch.setattr(session, "run_with_iobinding", lambda b, *a, _run=run, _s=session: (calls.append(_s), _run(b, *a))[1])
    out = t.forward_batch([TargetRow(s, ids, len(ids)) for s, ids in zip(seqs, news)], LAYERS)
    monkeypatch.undo()
    assert len(calls) == -(-n // t.max_batch)
    assert [s.length for s in seqs] == [len(p) + len(ids) for p, ids in zip(prompts, news)]
    for s, p, ids, logits, feats in zip(seqs, prompts, news, out.logits, out.features):
        alone = t.new_sequence()
        t.forward_batch([TargetRow(alone, p, 1)], LAYERS)
        ref = t.forward_batch([TargetRow(alone, ids, len(ids))], LAYERS)
        assert torch.equal(logits, ref.logits[0]) and torch.equal(feats, ref.features[0])
        after, again = (t.forward_batch([TargetRow(q, [7, 8], 2)], ()).logits[0] for q in (s, alone))
        assert torch.equal(after, again)  # the cache the batch call wrote is the one alone would have
        t.free(alone), t.free(s)


def test_rollback_is_as_if_the_rows_were_never_cached(ort_target):
    t = ort_target
    seq = t.new_sequence()
    t.forward_batch([TargetRow(seq, _ids(30), 1)], LAYERS)
    t.forward_batch([TargetRow(seq, _ids(8, 2), 8)], LAYERS)
    t.rollback(seq, 33)
    after = t.forward_batch([TargetRow(seq, _ids(4, 4), 4)], LAYERS)
    fresh = t.new_sequence()
    ref = t.forward_batch([TargetRow(fresh, _ids(30) + _ids(8, 2)[:3] + _ids(4, 4), 4)], LAYERS)
    assert torch.equal(after.logits[0], ref.logits[0]) and seq.length == 37
    t.free(seq), t.free(fresh)


def test_growing_past_the_first_buffer_keeps_the_cache(ort_target):
    t = ort_target
    seq, whole = t.new_sequence(), t.new_sequence()
    ids = _ids(300)
    for k in range(0, 300, 100):  # the K/V buffers start at 256 rows and double
        out = t.forward_batch([TargetRow(seq, ids[k : k + 100], 1)], ())
    ref = t.forward_batch([TargetRow(whole, ids, 1)], ())
    assert torch.equal(out.logits[0], ref.logits[0])
    t.free(seq), t.free(whole)


@pytest.mark.parametrize("block_size", [4, 16, None])
def test_greedy_with_drafts_is_the_backends_plain_greedy(ort_engine, block_size):
    from dflash.engine.engine import GenerationRequest

    for prompt in ("Write a Python function that reverses a string.", "Name three colors."):
        plain = ort_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, block_size=1))
        drafted = ort_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, block_size=block_size))
        assert drafted.output_ids == plain.output_ids
    assert ort_engine.draft_dtype == torch.qint8 and ort_engine.dflash.current.head.size < ort_engine.target.vocab_size


def test_a_long_prompt_is_the_same_whole_or_in_chunks(ort_target):
    """A prompt over MAX_ROWS (here 129 tokens of English) gives the same rows however it is
    prefilled: at once (the backend cuts it into calls of at most 128; one call of 129
    took another kernel path, 1.0 away in the logits) or in a scheduler's chunks."""
    t = ort_target
    text = " ".join(["The quick brown fox jumps over the lazy dog while the database commits."] * 12)
    ids = t.tokenizer(text, add_special_tokens=False)["input_ids"][:129]
    assert len(ids) == 129
    got = {}
    for chunks in ((len(ids),), (101, 28), (1, 128), (64, 65)):
        seq, at = t.new_sequence(), 0
        for n in chunks:
            out = t.forward_batch([TargetRow(seq, ids[at:at + n], 1)], LAYERS)
            at += n
        nxt = t.forward_batch([TargetRow(seq, [ids[0]], 1)], LAYERS)
        got[chunks] = (out.logits[0][-1], nxt.logits[0][-1])
        t.free(seq)
    whole = got.pop((len(ids),))
    for chunks, (last, nxt) in got.items():
        assert torch.equal(last, whole[0]), f"the prompt's last row, chunks {chunks}"
        assert torch.equal(nxt, whole[1]), f"the next token's logits, chunks {chunks}"


def test_batched_requests_get_what_they_get_alone(ort_engine):
    from dflash.engine.engine import GenerationRequest

    prompts = ["Name a fruit.", "Write a haiku about rain.", "What is 2 + 2?"]
    reqs = [GenerationRequest(prompt=p, max_new_tokens=24, block_size=None) for p in prompts]
    together = ort_engine.generate_many(reqs)
    for p, res in zip(prompts, together):
        alone = ort_engine.generate(GenerationRequest(prompt=p, max_new_tokens=24, block_size=1))
        assert res.output_ids == alone.output_ids


def test_a_copied_prefix_is_what_prefilling_it_gives(ort_target):
    """copy_prefix (the prefix cache's): a sequence that copies the first rows of another
    and prefills the rest gets, bit for bit, the logits and features of one that prefilled
    everything, and so does its next step."""
    t = ort_target
    shared, rest = _ids(45), _ids(9, 4)
    src = t.new_sequence()
    t.forward_batch([TargetRow(src, shared + _ids(20, 8), 1)], LAYERS)  # another answer after the prefix
    t.forward_batch([TargetRow(src, _ids(3, 2), 3)], LAYERS)
    fresh, copied = t.new_sequence(), t.new_sequence()
    ref = t.forward_batch([TargetRow(fresh, shared + rest, 2)], LAYERS)
    t.copy_prefix(src, copied, 40)
    assert copied.length == 40 and t.kv_bytes(copied) > 0
    got = t.forward_batch([TargetRow(copied, (shared + rest)[40:], 2)], LAYERS)
    assert torch.equal(got.logits[0], ref.logits[0])
    assert torch.equal(got.features[0], ref.features[0][40:])
    nxt = [t.forward_batch([TargetRow(s, [7, 8], 2)], LAYERS).logits[0] for s in (fresh, copied)]
    assert torch.equal(nxt[0], nxt[1])
    with pytest.raises(ValueError):
        t.copy_prefix(src, copied, 10)  # only into a sequence that caches nothing
    for s in (src, fresh, copied):
        t.free(s)


def test_a_workloads_next_prompt_reuses_its_shared_start_and_decodes_the_same(ort_engine):
    """The engine's prefix cache: a request whose prompt begins like an earlier one of its
    workload prefills only the rest, with the same greedy output as without the cache; a
    request of another workload, or one the drafter runs in, reuses nothing."""
    from dflash.engine.engine import GenerationRequest

    head = "Extract the contact details from the text below into JSON with the keys name and city. Text: "
    first, second = head + "Mara Quill lives in Denver.", head + "Tom Reyes works in Austin."
    ort_engine.workloads.load("pc:alice", [])
    ort_engine.workloads.load("pc:bob", [])
    ort_engine.workloads.load("pc:carol", [])
    req = lambda p, w, block=1: GenerationRequest(prompt=p, chat=True, max_new_tokens=12, block_size=block, workload=w)  # noqa: E731
    ort_engine.generate(req(first, "pc:alice"))
    hits = ort_engine.prefixes.hits
    other = ort_engine.generate(req(second, "pc:bob"))
    assert other.stats.cached_prompt_tokens == 0  # alice's prompt does not speed up bob's
    drafted = ort_engine.generate(req(second, "pc:alice", block=4))
    assert drafted.stats.cached_prompt_tokens == 0  # the drafter reads every prompt row's features
    again = ort_engine.generate(req(second, "pc:alice"))
    n = len(ort_engine.prompt_ids(req(second, "pc:alice")))
    assert 16 <= again.stats.cached_prompt_tokens < n and ort_engine.prefixes.hits > hits
    kept, ort_engine.prefixes = ort_engine.prefixes, None
    try:
        assert ort_engine.generate(req(second, "pc:carol")).output_ids == again.output_ids == other.output_ids
    finally:
        ort_engine.prefixes = kept
    assert ort_engine.prefixes.status()["bytes"] <= ort_engine.prefixes.cap_bytes
    # a kept sequence holds its cached rows only (and the few a call past them writes), not
    # the rows its buffers doubled to as it grew
    from dflash.engine.target.ort import MIN_ROWS

    t = ort_engine.target
    row = 2 * t.num_layers * t.kv_heads * t.head_dim * 4
    kept = list(ort_engine.prefixes.kept.values())
    assert kept and all(t.kv_bytes(k.seq) == (k.seq.length + MIN_ROWS) * row for k in kept)


def test_an_answer_the_grammar_ended_is_kept_for_the_workloads_next_prompt(ort_engine):
    """A constrained answer whose end the grammar forced (committed without a forward: its
    sequence caches one row fewer than an answer the target ended) is kept like any other,
    and the workload's next prompt reuses its shared start with the same answer."""
    from dflash.engine.engine import GenerationRequest

    head = "Classify the support ticket below as billing or other. Answer with the label only. Ticket: "
    ort_engine.workloads.load("pc:dave", [])

    def req(ticket, workload="pc:dave"):
        return GenerationRequest(prompt=head + ticket, chat=True, max_new_tokens=8, block_size=1, workload=workload,
                                 choices=["billing", "other"])

    kept = ort_engine.prefixes.status()["sequences"]
    first = ort_engine.generate(req("I was charged twice for one order."))
    assert first.finish_reason == "stop" and ort_engine.prefixes.status()["sequences"] == kept + 1
    again = ort_engine.generate(req("The app crashes when I open it."))
    assert again.stats.cached_prompt_tokens >= 16
    cache, ort_engine.prefixes = ort_engine.prefixes, None
    try:
        assert ort_engine.generate(req("The app crashes when I open it.", None)).output_ids == again.output_ids
    finally:
        ort_engine.prefixes = cache


def test_rows_that_arrive_together_copy_their_template_from_the_one_before(ort_engine):
    """A table's rows inserted at once are admitted together and prefill one after another
    (the step's token budget): each copies the template's rows from one that has cached them,
    and every answer is what it is alone."""
    from dflash.engine.engine import GenerationRequest

    head = "Write a one-line reply to this customer, thanking them and naming their order number. Customer: "
    prompts = [head + name for name in ("Lena Ortiz, order 10482.", "Sam Park, order 10483.", "Ada Byte, order 7.")]
    ort_engine.workloads.load("pc:table", [])
    # (the suffix proposer alone: a request the drafter runs in prefills every row for its features)
    reqs = [GenerationRequest(prompt=p, chat=True, max_new_tokens=10, workload="pc:table", proposers=("suffix",))
            for p in prompts]
    together = ort_engine.generate_many(reqs, budget=32)
    cached = [r.stats.cached_prompt_tokens for r in together]
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached
    for p, res in zip(prompts, together):
        alone = ort_engine.generate(GenerationRequest(prompt=p, chat=True, max_new_tokens=10, block_size=1))
        assert res.output_ids == alone.output_ids


def test_bad_model_files_are_clean_errors(tmp_path, smol_dir, ort_target):
    from tests.conftest import assert_bad_target

    corrupt, missing = tmp_path / "model.onnx", tmp_path / "missing.onnx"
    corrupt.write_bytes(b"not an onnx graph")
    for path in (corrupt, missing):
        assert_bad_target(lambda: ort.OrtTarget(path, smol_dir, threads=1), path)
    import onnx
    from onnx import TensorProto, helper

    other = tmp_path / "other.onnx"  # an ONNX graph, but not one of ours
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])), other)
    assert_bad_target(lambda: ort.OrtTarget(other, smol_dir, threads=1), other)
    assert_bad_target(lambda: onnx_target.ensure_export(tmp_path / "no-model-here", tmp_path / "out"),
                      tmp_path / "no-model-here")
    seq = ort_target.new_sequence()
    with pytest.raises(DFlashError) as err:
        ort_target.forward_batch([TargetRow(seq, [1, 2], 1)], (ort_target.num_layers,))
    assert err.value.code == "incompatible_drafter"
