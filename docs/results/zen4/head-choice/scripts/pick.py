"""The suffix policy replayed (dflash.bench.replay) with the first token of an ambiguous chain chosen with the
next-token head's probabilities (from headfeat.py's pickle), for several combination rules:
    python pick.py feat.pkl
"""
import sys, pickle
from collections import Counter
import numpy as np
import dflash.engine.proposers.suffix as S
import dflash.engine.proposers.suffix_index as SI
from dflash.bench import replay as R

D = pickle.load(open(sys.argv[1], "rb"))
vocab = D["vocab"]; pos_of = {int(t): i for i, t in enumerate(vocab)}
CUR = {"p": None}
MODE = {"v": "base", "eps": 0.01, "beta": 1.0}
STATS = Counter()

def first_choice(vals, counts, n, pseudo0):
    p = CUR["p"]
    j0 = int(np.argmax(counts))
    if MODE["v"] == "base" or p is None or len(vals) < 2 and MODE["v"] not in ("conf1", "mix", "odds1"):
        return int(vals[j0]), int(counts[j0]) / (n + pseudo0)
    hp = np.array([float(p[pos_of[int(t)]]) if int(t) in pos_of else 0.0 for t in vals])
    STATS["asked"] += 1
    score = counts * (hp + MODE["eps"]) ** MODE["beta"]
    j = int(np.argmax(score))
    if j != j0: STATS["flipped"] += 1
    conf = int(counts[j]) / (n + pseudo0)
    if MODE["v"] in ("odds", "odds1"):
        f = MODE["eps"]
        score = counts * (hp + f)
        j = int(np.argmax(score))
        other = pseudo0 * max(1.0 - float(hp.sum()), 0.0) + pseudo0 * f
        conf = score[j] / (score.sum() + other)
        return int(vals[j]), conf
    if MODE["v"] == "mix":
        a = MODE["eps"]
        score = counts + a * hp
        j = int(np.argmax(score))
        conf = score[j] / (n + a + pseudo0)
        return int(vals[j]), conf
    if MODE["v"] in ("conf", "conf1"):
        q = score[j] / score.sum()
        conf = q * n / (n + pseudo0)
    return int(vals[j]), conf

_walk = SI.Continuations.walk
def walk(self, max_tokens, first=None, first_confidence=None):
    if first is None and max_tokens > 0 and MODE["v"] != "base":
        vals, counts = self.first()
        t, c = first_choice(vals, counts, int(counts.sum()), self.pseudo(0))
        return _walk(self, max_tokens, t, c)
    return _walk(self, max_tokens, first, first_confidence)
SI.Continuations.walk = walk
orig_request = R._request
REQ = {"probs": None}
def patched_propose(self, items, _orig=S.SuffixProposer.propose):
    state = items[0][0]
    j = len(state.output_ids) - 1
    CUR["p"] = REQ["probs"][j] if j < len(REQ["probs"]) else None
    return _orig(self, items)
S.SuffixProposer.propose = patched_propose

def run(suite):
    reqs = D["data"][suite]
    outs = [r["output"] for r in reqs]
    it = iter(reqs)
    def req(proposer, curve, cfg, prompt, output, max_new, max_block):
        REQ["probs"] = next(it)["probs"]
        return orig_request(proposer, curve, cfg, prompt, output, max_new, max_block)
    R._request = req
    r = R.replay_suffix([q["prompt"] for q in reqs], outs, D["verify_s"], [q["timing"] for q in reqs], D["max_new"])
    return r

for v, eps, beta in [("odds", 0.01, 1), ("odds1", 0.01, 1), ("odds1", 0.05, 1), ("base", 0, 1), ("pick", 0.01, 1), ("pick", 0.05, 1), ("pick", 0.01, 0.5), ("conf", 0.01, 1), ("conf", 0.05, 1), ("conf1", 0.05, 1)]:
    MODE.update(v=v, eps=eps, beta=beta)
    row = []
    for s in D["data"]:
        STATS.clear()
        r = run(s)
        row.append(f"{s} {r['speedup']:.3f} tau {r['tau']:.2f} steps {r['steps']} asked {STATS['asked']} flip {STATS['flipped']}")
    print(v, eps, beta, " | ".join(row), flush=True)
