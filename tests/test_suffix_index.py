"""The suffix proposer's index: longest match, counts, updates, memory accounting, and a
property test against a brute-force reference (dflash/engine/proposers/suffix_index.py)."""

from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.engine.proposers.suffix_index import SuffixIndex, continuations_from, propose_from


def reference(docs: list[list[int]], context: list[int], max_tokens: int, min_match: int = 1,
              max_context: int = 32, prior: float = 1.0, per_context: bool = False):
    """The definition, by brute force: every (document, position) with a next token, its
    backward match with the context; the longest; then the most-frequent-next walk."""
    ctx = context[-max_context:] if max_context > 0 else []
    if max_tokens <= 0 or not ctx:
        return [], [], 0
    L = len(ctx)
    occ = []
    for doc in docs:
        for p in range(1, len(doc)):
            e = 0
            while e < L and e < p and doc[p - 1 - e] == ctx[L - 1 - e]:
                e += 1
            if e:
                occ.append((doc, p, e))
    best = max((e for _, _, e in occ), default=0)
    if best < max(1, min_match):
        return [], [], 0
    live = [(doc, p) for doc, p, e in occ if e == best]
    tokens, conf = [], []
    for i in range(max_tokens):
        nxt = [doc[p + i] for doc, p in live if p + i < len(doc)]
        if not nxt:
            break
        counts = Counter(nxt)
        c = max(counts.values())
        t = min(tok for tok, n in counts.items() if n == c)
        tokens.append(t)
        conf.append(c / (len(nxt) + (prior / (best + i) if per_context else prior)))
        live = [(doc, p) for doc, p in live if p + i < len(doc) and doc[p + i] == t]
    return tokens, conf, best


def assert_consistent(ix: SuffixIndex):
    """Internals: every level holds exactly the positions of its n-grams, keyed right."""
    tok = ix._tok
    for lev in ix._levels:
        want = {}
        for start, n in ix._docs.values():
            for p in range(start + lev.k, start + n + 1):
                want[p] = lev.hash(tok[p - lev.k:p].tolist())
        got = [(int(p), int(k)) for keys, pos in lev.runs for k, p in zip(keys, pos)]
        got += [(int(p), int(k)) for k, p in zip(lev.tail_k[:lev.tail_n], lev.tail_p[:lev.tail_n])]
        got += [(p, k) for k, ps in lev.recent.items() for p in ps]
        assert lev.recent_n == sum(map(len, lev.recent.values()))
        assert all(ps == sorted(ps) for ps in lev.recent.values())
        assert sorted(got) == sorted(want.items())
        for keys, pos in lev.runs:
            assert (np.diff(keys.astype(object)) >= 0).all()
    assert (tok[ix._used:] == -1).all() and tok[0] == -1
    assert all(tok[start + n] == -1 for start, n in ix._docs.values())
    assert sum(n + 1 for _, n in ix._docs.values()) + 1 == ix._used


def first_counts(docs: list[list[int]], context: list[int], max_context: int) -> Counter:
    """By brute force: how often each token followed the longest match of context's suffix."""
    ctx = context[-max_context:]
    occ = []
    for doc in docs:
        for p in range(1, len(doc)):
            e = 0
            while e < len(ctx) and e < p and doc[p - 1 - e] == ctx[len(ctx) - 1 - e]:
                e += 1
            if e:
                occ.append((doc[p], e))
    best = max((e for _, e in occ), default=0)
    return Counter(t for t, e in occ if e == best)


def check(ix_docs, docs, context, **kw):
    got = ix_docs.propose(context, **kw) if isinstance(ix_docs, SuffixIndex) else propose_from(ix_docs, context, **kw)
    want = reference(docs, context, **kw)
    assert got[0] == want[0] and got[2] == want[2], (got, want)
    assert got[1] == pytest.approx(want[1])
    # The first token chosen by someone else (the suffix proposer's head choice): the rest of
    # the chain is the walk over the occurrences that went that way, i.e. what the reference
    # proposes after the context with that token appended (where one of them goes on: else
    # that reference matches less and proposes something else).
    indexes = [ix_docs] if isinstance(ix_docs, SuffixIndex) else ix_docs
    found = continuations_from(indexes, context, **kw)
    assert (found is None) == (not got[0])
    if found is not None and kw.get("max_tokens", 0) >= 1:
        tokens, counts = found.first()
        max_context = kw.get("max_context", 32)
        assert dict(zip(tokens.tolist(), counts.tolist())) == first_counts(docs, context, max_context)
        for t in tokens.tolist():
            forced = found.walk(kw["max_tokens"], t, 0.25)
            rest = reference(docs, list(context[-max_context:]) + [t], kw["max_tokens"] - 1,
                             max_context=max_context + 1, prior=kw.get("prior", 1.0),
                             per_context=kw.get("per_context", False))
            if rest[2] != found.match + 1:  # no occurrence that went that way goes on
                rest = ([], [], 0)
            assert forced[0] == [t] + rest[0] and forced[1] == pytest.approx([0.25] + rest[1])
    return got


# ---- matches -------------------------------------------------------------------------------

def test_longest_match_wins_over_shorter_ones():
    ix = SuffixIndex()
    ix.add("short", [5, 6, 7, 8, 9])  # "6 7" then 8
    ix.add("long", [1, 2, 3, 6, 7, 40, 41, 42])  # "2 3 6 7" then 40 41 42
    tokens, conf, n = ix.propose([0, 2, 3, 6, 7], 5)
    assert n == 4 and tokens == [40, 41, 42]
    # without the longer context only "6 7" matches: two occurrences, a tie, smallest id first
    tokens, conf, n = ix.propose([0, 6, 7], 5)
    assert n == 2 and tokens[0] == 8 and conf[0] == pytest.approx(1 / 3)


def test_match_longer_than_every_level_and_capped_by_max_context():
    text = list(range(100, 160))
    ix = SuffixIndex()
    ix.add("d", text + [7] + text[:10])
    tokens, _, n = ix.propose(text[:10], 4)
    assert n == 10 and tokens == text[10:14]
    tokens, _, n = ix.propose(text[:40], 3, max_context=24)
    assert n == 24 and tokens == text[40:43]


def test_continuation_stops_at_document_end_and_never_crosses_documents():
    ix = SuffixIndex()
    ix.add(1, [1, 2, 3])
    ix.add(2, [4, 5, 6])
    tokens, _, n = ix.propose([1], 10)
    assert (tokens, n) == ([2, 3], 1)
    assert ix.propose([3, 4], 5)[2] == 1  # "3 4" spans the two documents: only "4" matches
    assert ix.propose([3, 4], 5)[0] == [5, 6]


def test_min_match_and_empty_inputs():
    ix = SuffixIndex()
    ix.add("d", [1, 2, 3, 4])
    assert ix.propose([9, 2], 3, min_match=2) == ([], [], 0)
    assert ix.propose([9, 2], 3, min_match=1)[0] == [3, 4]
    assert ix.propose([], 3) == ([], [], 0)
    assert ix.propose([1, 2], 0) == ([], [], 0)
    assert SuffixIndex().propose([1, 2], 3) == ([], [], 0)
    assert ix.propose([2, -1], 3) == ([], [], 0)  # a negative id is no token; it never matches the sentinel


# ---- confidences ---------------------------------------------------------------------------

def test_confidence_is_count_over_support_plus_prior():
    ix = SuffixIndex()
    for i, nxt in enumerate([10, 10, 10, 11]):
        ix.add(i, [1, 2, nxt, 20 + (i % 2)])
    tokens, conf, n = ix.propose([1, 2], 3)
    # four occurrences of "1 2": 10 three times -> 3 / (4 + 1); then among those three, 20 twice
    # (i = 0, 2) and 21 once -> 2 / (3 + 1); then one occurrence of "1 2 10 20" that ends there
    assert n == 2 and tokens == [10, 20]
    assert conf == pytest.approx([3 / 5, 2 / 4])
    _, conf, _ = ix.propose([1, 2], 3, prior=0.0)
    assert conf == pytest.approx([3 / 4, 2 / 3])


def test_one_occurrence_gives_its_tokens_at_half_confidence():
    ix = SuffixIndex()
    ix.add("d", [3, 1, 4, 1, 5, 9, 2, 6])
    tokens, conf, n = ix.propose([8, 5], 4)
    assert tokens == [9, 2, 6] and conf == pytest.approx([0.5] * 3) and n == 1


def test_per_context_confidence_grows_with_the_context_agreed_on():
    ix = SuffixIndex()
    ix.add("d", [3, 1, 4, 1, 5, 9, 2, 6])
    # one occurrence of "5" (a one-token match): the pseudo-count 1 over 1, 2, 3 agreed tokens
    tokens, conf, n = ix.propose([8, 5], 4, per_context=True)
    assert tokens == [9, 2, 6] and n == 1 and conf == pytest.approx([1 / 2, 1 / 1.5, 1 / (1 + 1 / 3)])
    # "4 1 5" matches three tokens: 1 / (1 + 1/3), then 1 / (1 + 1/4) ...
    _, conf, n = ix.propose([4, 1, 5], 2, per_context=True)
    assert n == 3 and conf == pytest.approx([0.75, 0.8])
    # counts still count: two occurrences that disagree after a two-token match
    ix2 = SuffixIndex()
    ix2.add("a", [1, 2, 10])
    ix2.add("b", [1, 2, 11])
    _, conf, n = ix2.propose([1, 2], 1, per_context=True)
    assert n == 2 and conf == pytest.approx([1 / (2 + 1 / 2)])


# ---- updates -------------------------------------------------------------------------------

def test_extend_makes_new_matches_available_and_self_match_is_excluded():
    ix = SuffixIndex()
    own = [1, 2, 3, 4]
    ix.add("req", own)
    # the context is the document itself: its suffix occurs only at its own end
    assert ix.propose(own, 4) == ([], [], 0)
    ix.extend("req", [1, 2])
    own += [1, 2]
    tokens, conf, n = ix.propose(own, 4)  # "1 2" occurred earlier in the same document
    assert n == 2 and tokens == [3, 4, 1, 2]
    ix.extend("req", [3])
    own += [3]
    tokens, _, n = ix.propose(own, 4)
    assert n == 3 and tokens == [4, 1, 2, 3]
    assert ix.tokens("req") == own


def test_extend_an_older_document_moves_it_and_keeps_everything_findable():
    ix = SuffixIndex(tail_max=4)
    ix.add("a", [1, 2, 3])
    ix.add("b", [7, 8, 9])
    ix.extend("a", [4, 5])
    assert ix.doc_ids() == ["b", "a"] and ix.tokens("a") == [1, 2, 3, 4, 5]
    assert ix.propose([0, 3], 3)[0] == [4, 5]
    assert ix.propose([0, 7], 3)[0] == [8, 9]
    ix.extend("new", [5, 6])  # extend of an unknown id creates it
    assert ix.tokens("new") == [5, 6] and ix.num_tokens == 10


def test_remove_drops_matches():
    ix = SuffixIndex()
    ix.add("a", [1, 2, 3, 4])
    ix.add("b", [1, 2, 9, 9])
    assert ix.propose([1, 2], 2)[1][0] == pytest.approx(1 / 3)
    ix.remove("a")
    assert ix.propose([1, 2], 2) == ([9, 9], [0.5, 0.5], 2)
    assert ix.propose([3], 2) == ([], [], 0)
    with pytest.raises(KeyError):
        ix.remove("a")
    ix.add("b", [1, 2, 5])  # add replaces
    assert ix.propose([1, 2], 2)[0] == [5] and len(ix) == 1


def test_bad_documents_are_refused():
    ix = SuffixIndex()
    with pytest.raises(ValueError):
        ix.add("d", [1, -2])
    with pytest.raises(TypeError):
        ix.add("d", [1.5])
    with pytest.raises(ValueError):
        ix.add("d", [[1, 2]])
    assert len(ix) == 0


def test_own_index_and_memory_are_counted_together():
    own, mem = SuffixIndex(), SuffixIndex()
    mem.add("past-1", [1, 2, 3, 4])
    mem.add("past-2", [1, 2, 3, 5])
    own.add("req", [9, 1, 2, 3, 5, 9, 1, 2, 3])
    tokens, conf, n = propose_from([own, mem], own.tokens("req"), 3)
    # "9 1 2 3" occurs once earlier in the request itself: the longest match, from own alone
    assert n == 4 and tokens == [5, 9, 1] and conf[0] == pytest.approx(1 / 2)
    tokens, conf, n = propose_from([own, mem], [7, 1, 2, 3], 1)
    # "1 2 3": once in own (-> 5), twice in memory (-> 4, 5): 5 twice of three
    assert n == 3 and tokens == [5] and conf == pytest.approx([2 / 4])
    assert propose_from([mem, own], [7, 1, 2, 3], 1) == (tokens, conf, n)


# ---- bounds --------------------------------------------------------------------------------

def test_size_grows_with_content_and_falls_after_remove():
    rng = np.random.default_rng(0)
    ix = SuffixIndex()
    empty = ix.size_bytes()
    sizes = []
    for i in range(8):
        ix.add(i, rng.integers(0, 1000, 5000))
        sizes.append(ix.size_bytes())
    assert empty < sizes[0] < sizes[-1]
    ix.remove_many(range(6))
    assert ix.size_bytes() < sizes[-1] / 2
    ix.remove_many([6, 7])
    assert ix.size_bytes() < sizes[0]
    assert ix.num_tokens == 0 and ix.propose([1, 2], 3) == ([], [], 0)
    for i in range(8):
        ix.add(i, rng.integers(0, 1000, 5000))
    full = ix.size_bytes()
    removed = ix.evict_oldest(full // 2, keep=[0])
    assert 0 not in removed and removed == list(range(1, 1 + len(removed)))
    assert ix.size_bytes() <= full // 2 and 0 in ix and len(removed) >= 3
    assert ix.evict_oldest(ix.size_bytes()) == []


def test_a_10mb_workload_memory_under_a_cap_kept_by_the_caller():
    """The caller adds past outputs and evicts the oldest while over its byte cap; the
    accounting is about linear in the tokens held, so the cap holds about cap / 40 tokens."""
    cap = 10 << 20
    rng = np.random.default_rng(1)
    phrases = [rng.integers(0, 8000, rng.integers(5, 40)) for _ in range(300)]
    ix = SuffixIndex()
    t0 = time.perf_counter()
    added = 0
    per_token = []
    for i in range(200):
        doc = np.concatenate([phrases[j] for j in rng.integers(0, len(phrases), 60)])[:1500]
        ix.add(i, doc)
        added += len(doc)
        while ix.size_bytes() > cap:
            ix.remove(ix.doc_ids()[0])
        if ix.num_tokens > 50_000:
            per_token.append(ix.size_bytes() / ix.num_tokens)
    took = time.perf_counter() - t0
    assert ix.size_bytes() <= cap
    assert added > ix.num_tokens > cap / 80  # evictions happened, and the cap holds a fair amount
    assert 20 < min(per_token) and max(per_token) < 80  # bytes per token: about linear
    t0 = time.perf_counter()
    for _ in range(50):
        ix.propose(doc[-40:-20].tolist(), 15)
    print(f"\n10 MB memory: {ix.num_tokens} tokens in {len(ix)} docs, {ix.size_bytes() / ix.num_tokens:.1f} B/token, "
          f"{added} tokens added with evictions in {took:.2f}s, propose {(time.perf_counter() - t0) / 50 * 1e6:.0f} us")


# ---- determinism and scale ----------------------------------------------------------------

def test_deterministic_across_builds_and_update_paths():
    rng = random.Random(3)
    docs = [[rng.randrange(6) for _ in range(rng.randrange(5, 60))] for _ in range(12)]
    a, b = SuffixIndex(), SuffixIndex(tail_max=3, levels=(1, 2, 5))
    for i, d in enumerate(docs):
        a.add(i, d)
        for j in range(0, len(d), 7):  # built by extends instead, with tiny tails (many merges)
            b.extend(i, d[j:j + 7])
    for _ in range(200):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        assert a.propose(ctx, 6) == b.propose(ctx, 6) == a.propose(ctx, 6)


def test_a_large_memory_and_a_growing_own_index_propose_real_longest_matches():
    """A workload's memory of 200k tokens (Zipf text from repeated phrases) and a request's own
    index grown 4 tokens a step, as the suffix proposer queries them: the memory holds about
    40 bytes a token (the module docstring's accounting), the own index grown by extends
    proposes exactly what the same text added whole does, and each proposal continues the
    longest match of its context over both indexes, checked by brute force over the text."""
    rng = np.random.default_rng(7)
    vocab = rng.zipf(1.3, 200_000) % 49_000
    phrases = [vocab[rng.integers(0, len(vocab), rng.integers(4, 30))] for _ in range(2000)]
    mem, docs = SuffixIndex(), []
    while sum(map(len, docs)) < 200_000:
        docs.append(np.concatenate([phrases[j] for j in rng.integers(0, len(phrases), 30)]))
        mem.add(len(docs) - 1, docs[-1])
    assert 36 < mem.size_bytes() / mem.num_tokens < 48
    own, whole = SuffixIndex(), SuffixIndex()
    own.add("req", docs[5][:300])
    for j in range(300, len(docs[5]), 4):
        own.extend("req", docs[5][j:j + 4])
    whole.add("req", docs[5])
    # Contexts with a full-length match (copied from the memory) and random common tokens
    # (short matches with many occurrences).
    ctxs = [docs[i][k - 32:k].tolist() for i in range(0, len(docs), 40) for k in (40, 200)]
    ctxs += [rng.choice(vocab, 32).tolist() for _ in range(len(ctxs))]
    # The text as one array, each document ended by -1: no match crosses one, none follows one.
    flat = np.concatenate([np.append(d, -1) for d in [*docs, docs[5]]])

    def followers(suffix: list[int]) -> Counter:
        """How often each token follows an occurrence of `suffix` in a document."""
        after = np.arange(len(suffix), len(flat))  # positions with len(suffix) tokens before them
        for j, t in enumerate(reversed(suffix), 1):
            after = after[flat[after - j] == t]
        return Counter(int(t) for t in flat[after] if t >= 0)

    for n, ctx in enumerate(ctxs):
        tokens, conf, match = propose_from([own, mem], ctx, 15)
        assert (tokens, conf, match) == propose_from([whole, mem], ctx, 15)
        if n < len(ctxs) // 2:
            assert match == 32 and tokens  # the context itself is in the memory
        assert all(0 < c < 1 for c in conf)
        assert not tokens or tokens[0] in followers(ctx[-match:])
        # Exact when every occurrence is looked at (by default only the newest 256 of a
        # common n-gram are, which may miss a longer match): the longest match, and its most
        # frequent next token (the smallest id of equals).
        tokens, _, match = propose_from([own, mem], ctx, 15, max_occurrences=len(flat))
        assert match >= propose_from([own, mem], ctx, 15)[2]
        if match == 0:
            assert not tokens and not followers(ctx[-1:])
            continue
        assert match == 32 or not followers(ctx[-match - 1:]), ctx  # no longer match has a next token
        counts = followers(ctx[-match:])
        assert tokens[0] == min(counts, key=lambda t: (-counts[t], t)), ctx


# ---- property: the index agrees with the brute-force definition ----------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 5), st.lists(st.integers(0, 3), max_size=25)),
        st.tuples(st.just("extend"), st.integers(0, 5), st.lists(st.integers(0, 3), max_size=6)),
        st.tuples(st.just("remove"), st.integers(0, 5), st.just([])),
        st.tuples(st.just("remove_many"), st.integers(0, 5), st.lists(st.integers(0, 5), max_size=3)),
    ),
    max_size=14,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, levels=st.sampled_from([(1,), (1, 4, 16), (2, 3), (1, 2, 5, 9)]), tail=st.sampled_from([1, 3, 8192]),
       queries=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=12), st.integers(1, 7), st.integers(1, 3),
                                  st.integers(1, 10)), min_size=1, max_size=8),
       split=st.booleans(), per_context=st.booleans())
def test_matches_brute_force(ops, levels, tail, queries, split, per_context):
    indexes = [SuffixIndex(levels=levels, tail_max=tail)]
    if split:  # documents spread over two indexes, queried together
        indexes.append(SuffixIndex(levels=levels, tail_max=tail))
    docs: dict[int, list[int]] = {}
    for op, d, toks in ops:
        ix = indexes[d % len(indexes)]
        if op == "add":
            ix.add(d, toks)
            docs.pop(d, None)
            docs[d] = list(toks)
        elif op == "extend":
            ix.extend(d, toks)
            if d in docs and toks and ix.doc_ids()[-1] == d:
                docs[d] = docs.pop(d)
            docs[d] = docs.get(d, []) + list(toks)
        elif op == "remove" and d in docs:
            ix.remove(d)
            del docs[d]
        elif op == "remove_many":
            ids = [e for e in dict.fromkeys([d, *toks]) if e in ix]
            ix.remove_many(ids)
            for e in ids:
                del docs[e]
    for d, toks in docs.items():
        assert indexes[d % len(indexes)].tokens(d) == toks
    for ix in indexes:
        assert_consistent(ix)
    assert sum(ix.num_tokens for ix in indexes) == sum(map(len, docs.values()))
    for ctx, max_tokens, min_match, max_context in queries:
        for own in list(docs.values())[-1:]:  # also the newest document's own text, as a request's context
            check(indexes, list(docs.values()), own, max_tokens=max_tokens, min_match=min_match,
                  max_context=max_context, per_context=per_context)
        check(indexes, list(docs.values()), ctx, max_tokens=max_tokens, min_match=min_match,
              max_context=max_context, per_context=per_context)
