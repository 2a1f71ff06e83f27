"""The prefix cache's bookkeeping (dflash.engine.prefix_cache), on a stand-in target that
records copies: which kept sequence a prompt reuses and how much, per workload, within
its byte cap, least recently used first. Exactness on a real backend is in
tests/test_ort_target.py."""

from dataclasses import dataclass, field

from dflash.engine.prefix_cache import PrefixCache, common_prefix


@dataclass
class Seq:
    length: int = 0
    freed: bool = False
    serial: int = field(default_factory=lambda: Seq.count())
    _n = [0]

    @staticmethod
    def count() -> int:
        Seq._n[0] += 1
        return Seq._n[0]


class Target:
    copies_prefix = True

    def __init__(self, row_bytes: int = 10):
        self.row_bytes, self.copies, self.shrunk = row_bytes, [], []

    def shrink(self, seq):
        self.shrunk.append(seq.serial)

    def copy_prefix(self, src, dst, n):
        assert dst.length == 0 and n <= src.length
        self.copies.append((src.serial, n))
        dst.length = n

    def kv_bytes(self, seq):
        return seq.length * self.row_bytes

    def free(self, seq):
        seq.freed = True


def _kept(cache, workload, ids):
    seq = Seq(len(ids))
    return seq, cache.keep(workload, ids, seq)


def test_a_prompt_reuses_the_longest_shared_start_of_its_own_workload_only():
    t = Target()
    cache = PrefixCache(t, cap_bytes=10_000, min_tokens=4)
    a, _ = _kept(cache, "alice", list(range(30)))
    b, _ = _kept(cache, "alice", list(range(10)) + [99] * 20)
    _kept(cache, "bob", list(range(40)))
    prompt = list(range(25)) + [7, 7]
    seq = Seq()
    assert cache.reuse("alice", prompt, seq) == 25 and t.copies[-1] == (a.serial, 25) and seq.length == 25
    assert cache.reuse("carol", prompt, Seq()) == 0  # another workload's prompts are not its to reuse
    assert cache.reuse("alice", list(range(12)), Seq()) == 11  # never the prompt's last token: it gives the logits
    assert cache.reuse("alice", [5, 6, 7, 8, 9], Seq()) == 0  # no shared start
    assert cache.reuse("alice", list(range(3)) + [50] * 9, Seq()) == 0  # under min_tokens
    assert cache.status() == {"sequences": 3, "bytes": 1000, "cap_bytes": 10_000, "hits": 2,
                             "reused_tokens": 36, "evicted": 0}
    assert not b.freed


def test_the_cap_frees_the_least_recently_used_and_a_longer_run_replaces_its_start():
    t = Target()  # 10 bytes a row: two kept runs of 4 tokens fit under the cap of 100
    cache = PrefixCache(t, cap_bytes=100, min_tokens=4)
    s1, _ = _kept(cache, "w", [1] * 4)
    s2, _ = _kept(cache, "w", [3] * 4)
    s3, _ = _kept(cache, "w", [4] * 4)
    assert s1.freed and not s2.freed and cache.evicted == 1  # the least recently used went for room
    assert cache.reuse("w", [3] * 4 + [0], Seq()) == 4  # s2 is now the most recently used
    s4, _ = _kept(cache, "w", [5] * 4)
    assert s3.freed and not s2.freed and not s4.freed and cache.size_bytes == 80
    longer, ok = _kept(cache, "w", [3] * 4 + [6] * 4)  # begins with s2's tokens: s2 goes
    assert ok and s2.freed and s4.freed and not longer.freed  # ... and s4 for room
    assert cache.size_bytes == 80 and cache.status()["sequences"] == 1
    covered = _kept(cache, "w", [3] * 4 + [6] * 2)
    assert covered[1] is False  # all of it is in `longer` already
    short = _kept(cache, "w", [1, 2])
    assert short[1] is False  # too short to be worth keeping
    # what is kept gives back its spare rows first; what is declined is left to its caller
    assert longer.serial in t.shrunk and s4.serial in t.shrunk
    assert covered[0].serial not in t.shrunk and short[0].serial not in t.shrunk


def test_a_running_request_of_the_workload_is_copied_from_too():
    t = Target()
    cache = PrefixCache(t, cap_bytes=10_000, min_tokens=4)
    _kept(cache, "w", list(range(8)))
    running = Seq(20)
    prompt = list(range(12)) + [99]
    assert cache.reuse("w", prompt, Seq(), live=[(list(range(20)), running)]) == 12
    assert t.copies[-1] == (running.serial, 12)
    assert cache.reuse("w", prompt, Seq(), live=[(list(range(3)), running)]) == 8  # the kept one is longer


def test_an_entry_larger_than_the_cap_is_not_kept():
    cache = PrefixCache(Target(row_bytes=1000), cap_bytes=5000, min_tokens=2)
    seq, ok = _kept(cache, "w", list(range(10)))
    assert not ok and not seq.freed and cache.status()["sequences"] == 0  # the caller frees it


def test_common_prefix():
    import random

    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2 and common_prefix([1], [2]) == 0
    rng = random.Random(7)
    for _ in range(200):  # the binary search against the obvious loop
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n
