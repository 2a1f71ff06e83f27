"""LLGuidance against XGrammar on this CPU, with the target's tokenizers: what chose the library.

    PYTHONPATH=/tmp/xg python -m tools.grammar_libraries [--tokenizer DIR ...] [--rounds 15] [--out DIR]

XGrammar is not a dependency (it pulls torch, transformers, triton and pydantic): install it
beside the venv for a comparison, `pip install --no-deps --target /tmp/xg xgrammar
apache-tvm-ffi`, and put that folder on PYTHONPATH (it uses the venv's torch and
transformers). Without it only LLGuidance is measured.

For each tokenizer (default: the default target's; add Qwen2.5's folder with --tokenizer)
and each constraint (a nested JSON schema with enums and arrays, a date regex, an email
regex, a choice of five labels), both libraries are given the same grammar (JSON on one
line with ", " and ": " between items, dflash's JSON_FORMAT) and measured in the same
rounds, interleaved, their order alternating, so drift on a shared machine hits both:
- compile: from the constraint to the first mask, nothing cached (median of the rounds);
- mask: one next-token bitmask along a valid answer's tokens, per token (median over
  every token of every round); advance: accepting one token;
- correct: every valid answer's tokens (unicode, escapes, numbers) are accepted to the
  end, where the end of sequence is allowed; every invalid one is refused; the two
  libraries' masks agree token for token along the valid answers (counted where not);
- rollback: k tokens undone give the mask recorded there;
- schemas with a keyword LLGuidance does not implement: refused, or compiled with the
  keyword ignored;
- forced: the tokens the grammar forces along the answer, and whether they are the
  tokens the tokenizer writes there (LLGuidance's forced tokens; XGrammar's jump-forward
  string, tokenised alone);
- dflash's own path (LLGuidance): a request's matcher from the cache, the masks of a
  verify of 4 drafts per row, and the greedy verify of 5 rows with and without them.
Writes DIR/grammar_libraries.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dflash.bench.timing import write_json_report
from dflash.engine.costs import cpu_name
from dflash.engine.grammar import JSON_FORMAT, Matcher, Vocabulary, parse_constraint
from dflash.model_files import default_target_dir

TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"},
            "plan": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "email", "plan"], "additionalProperties": False},
        "category": {"enum": ["billing", "bug", "feature", "account", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer"}},
            "required": ["sku", "quantity"], "additionalProperties": False}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "refund": {"type": "boolean"},
        "summary": {"type": "string"},
    },
    "required": ["customer", "category", "priority", "items", "tags", "refund", "summary"],
    "additionalProperties": False,
}
LABELS = ["billing", "technical issue", "account access", "feature request", "other"]
DATE = r"\d{4}-\d{2}-\d{2}"
EMAIL = r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"


def _ticket(name, email, plan, category, priority, items, tags, refund, summary) -> str:
    return json.dumps({"customer": {"name": name, "email": email, "plan": plan}, "category": category,
                       "priority": priority, "items": [{"sku": s, "quantity": q} for s, q in items], "tags": tags,
                       "refund": refund, "summary": summary}, ensure_ascii=False)


# (name, constraint, valid answers (the first is timed), invalid answers)
CASES = [
    ("json_schema", {"json_schema": TICKET_SCHEMA}, [
        _ticket("Ada Lovelace", "ada@example.org", "pro", "billing", 2, [("AB-100", 1), ("CD-7", 3)],
                ["invoice", "double charge"], True, "Charged twice for the March invoice; asks for a refund."),
        _ticket("Zoë Ærøskøbing", "zoe@example.dk", "free", "bug", 5, [], [], False,
                "The app crashes 🙁 when I press \"save\"\nafter editing."),
        _ticket("李雷", "li@example.cn", "enterprise", "other", 1, [("X", 10)], ["中文"], False, "ok"),
    ], [
        '{"customer": {"name": "A", "email": "a@b.c", "plan": "gold"}',  # not an enum value
        '{"category": "bug"}',  # properties out of order / missing
        '{"customer": {"name": "A", "email": "a@b.c", "plan": "pro"}, "category": "bug", "priority": "high"',
        '{ "customer"',  # whitespace JSON_FORMAT does not allow
    ]),
    ("regex_date", {"regex": DATE}, ["2026-12-06", "1999-01-31"], ["2026-1-06", "2026/12/06", "20261206x"]),
    ("regex_email", {"regex": EMAIL}, ["ada.lovelace@example.org", "x+tag@mail.example.co"],
     ["Ada@example.org", "no-at-sign.example.org", "a@b.c"]),
    ("choices", {"choices": LABELS}, LABELS, ["Billing", "technical", "billing!"]),
]


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size, eos):
        import llguidance

        self.version = llguidance.__version__
        t = time.perf_counter()
        self.vocab = Vocabulary(tokenizer, vocab_size, eos)  # not Vocabulary.of: timed fresh
        self.tokenizer_s = time.perf_counter() - t

    def compile(self, constraint):
        from llguidance import LLMatcher

        m = LLMatcher(self.vocab.ll, parse_constraint(**constraint).grammar, log_level=0)
        m.compute_bitmask()
        return m

    def matcher(self, constraint):
        return Matcher.start(parse_constraint(**constraint), self.vocab)._m

    @staticmethod
    def mask(m):
        return m.compute_bitmask()

    @staticmethod
    def bits(mask) -> bytes:
        return bytes(mask)

    @staticmethod
    def accept(m, token) -> bool:
        return m.consume_token(token)

    @staticmethod
    def rollback(m, k):
        m.rollback(k)

    @staticmethod
    def accepting(m) -> bool:
        return m.is_accepting()

    def forced(self, m, tokenizer) -> list[int]:
        return list(m.compute_ff_tokens())


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, eos):
        import xgrammar as xgr

        self.xgr = xgr
        from importlib.metadata import version

        try:
            self.version = version("xgrammar")
        except Exception:  # installed with --target: no metadata on the path
            self.version = "?"
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos))
        self.tokenizer_s = time.perf_counter() - t
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cached = xgr.GrammarCompiler(self.info, max_threads=1)
        self.buf = xgr.allocate_token_bitmask(1, vocab_size)

    def _compiled(self, compiler, constraint):
        if "json_schema" in constraint:
            return compiler.compile_json_schema(json.dumps(constraint["json_schema"]), any_whitespace=False,
                                                separators=(JSON_FORMAT["item_separator"],
                                                            JSON_FORMAT["key_separator"]), strict_mode=True)
        if "regex" in constraint:
            return compiler.compile_regex(constraint["regex"])
        ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint["choices"])
        return compiler.compile_grammar(ebnf)

    def compile(self, constraint):
        m = self.xgr.GrammarMatcher(self._compiled(self.compiler, constraint))
        m.fill_next_token_bitmask(self.buf)
        return m

    def matcher(self, constraint):
        return self.xgr.GrammarMatcher(self._compiled(self.cached, constraint))

    def mask(self, m):
        m.fill_next_token_bitmask(self.buf)
        return self.buf

    @staticmethod
    def bits(mask) -> bytes:
        return mask[0].numpy().tobytes()

    @staticmethod
    def accept(m, token) -> bool:
        return m.accept_token(token)

    @staticmethod
    def rollback(m, k):
        m.rollback(k)

    @staticmethod
    def accepting(m) -> bool:
        return m.is_completed()

    def forced(self, m, tokenizer) -> list[int]:
        text = m.find_jump_forward_string()
        return tokenizer.encode(text, add_special_tokens=False) if text else []


def _differ(a: bytes, b: bytes, vocab_size: int) -> tuple[list[int], list[int]]:
    """Token ids the first bitmask allows and the second does not, and the other way."""
    import numpy as np

    x = np.unpackbits(np.frombuffer(a, np.uint8), bitorder="little")[:vocab_size].astype(bool)
    y = np.unpackbits(np.frombuffer(b, np.uint8), bitorder="little")[:vocab_size].astype(bool)
    return np.nonzero(x & ~y)[0].tolist(), np.nonzero(y & ~x)[0].tolist()


def walk(lib, constraint, ids, eos) -> dict:
    """Accept a valid answer's tokens one by one; the mask before each, and the checks."""
    m = lib.matcher(constraint)
    masks, ok_to = [], 0
    for t in ids:
        masks.append(lib.bits(lib.mask(m)))
        if not lib.accept(m, t):
            break
        ok_to += 1
    end = lib.bits(lib.mask(m)) if ok_to == len(ids) else b""
    import numpy as np

    allowed = set(np.nonzero(np.unpackbits(np.frombuffer(end, np.uint8), bitorder="little"))[0].tolist()) if end else set()
    ends = lib.accepting(m) and bool(allowed & set(eos))
    k = min(5, ok_to)
    lib.rollback(m, k)
    rolled = lib.bits(lib.mask(m)) == masks[ok_to - k] if ok_to and k else True
    return {"accepted": ok_to, "tokens": len(ids), "may_end": ends, "rollback_ok": rolled,
            "masks": masks + [end]}


def refuses(lib, constraint, ids) -> bool:
    m = lib.matcher(constraint)
    for t in ids:
        lib.mask(m)
        if not lib.accept(m, t):
            return True
    return not lib.accepting(m)


def forced_along(lib, constraint, ids, tokenizer) -> dict:
    """Walk the answer; wherever the grammar forces tokens, take them as a draft: how many
    of the answer's tokens came forced, and how many forced runs were not the answer's."""
    m = lib.matcher(constraint)
    i, forced, runs, wrong = 0, 0, 0, 0
    while i < len(ids):
        run = lib.forced(m, tokenizer)
        if run:
            runs += 1
            n = 0
            while n < len(run) and i + n < len(ids) and run[n] == ids[i + n]:
                n += 1
            if n < len(run) and i + n < len(ids):
                wrong += 1
            forced += n
            for t in ids[i:i + max(n, 1)]:
                lib.accept(m, t)
            i += max(n, 1)
        else:
            lib.accept(m, ids[i])
            i += 1
    return {"forced_tokens": forced, "tokens": len(ids), "runs": runs, "runs_not_the_tokenizers": wrong}


# Valid JSON Schema that LLGuidance does not implement: a library must refuse it, not
# compile it and ignore the keyword (its output would not validate).
UNIMPLEMENTED = {
    "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    "if/then": {"if": {"type": "string"}, "then": {"maxLength": 3}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
}


def unimplemented(lib) -> dict:
    """For each schema in UNIMPLEMENTED: "refused" or "compiled" (the keyword ignored)."""
    out = {}
    for name, schema in UNIMPLEMENTED.items():
        try:
            lib.compile({"json_schema": schema})
            out[name] = "compiled"
        except Exception:  # LLGuidance: DFlashError; XGrammar: RuntimeError
            out[name] = "refused"
    return out


def dflash_path(vocab: Vocabulary, ids: list[int], rounds: int) -> dict:
    """What the step will pay on top of the library (LLGuidance): a request's matcher from
    the cache, the masks of a verify of 4 drafted tokens along the answer (per row, into
    bools), and applying them to fp32 logits in the greedy verify, against that verify
    without a mask."""
    import torch

    from dflash.engine.sampling import verify_greedy

    c = parse_constraint(json_schema=TICKET_SCHEMA)
    Matcher.start(c, vocab)
    logits = torch.randn(5, vocab.vocab_size)
    times = {"start_us": [], "masks_per_row_us": [], "verify_greedy_masked_us": [], "verify_greedy_us": []}
    for _ in range(rounds):
        t = time.perf_counter()
        m = Matcher.start(c, vocab)
        times["start_us"].append(time.perf_counter() - t)
        for i in range(0, len(ids) - 4, 4):
            draft = ids[i:i + 4]
            t = time.perf_counter()
            rows = m.masks(draft)
            times["masks_per_row_us"].append((time.perf_counter() - t) / 5)
            d = torch.tensor(draft)
            t = time.perf_counter()
            verify_greedy(d, logits, rows)
            t1 = time.perf_counter()
            verify_greedy(d, logits)
            times["verify_greedy_masked_us"].append(t1 - t)
            times["verify_greedy_us"].append(time.perf_counter() - t1)
            m.advance(draft)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def measure(tokenizer_dir: Path, rounds: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    vocab_size = int(cfg["vocab_size"])
    eos = sorted({tokenizer.eos_token_id} | set(cfg.get("eos_token_id") if isinstance(cfg.get("eos_token_id"), list)
                                                else [cfg.get("eos_token_id", tokenizer.eos_token_id)]))
    libs = [LLGuidance(tokenizer, vocab_size, eos)]
    try:
        libs.append(XGrammar(tokenizer, vocab_size, eos))
    except ImportError:
        print("xgrammar is not importable: LLGuidance only")
    out = {"tokenizer": tokenizer_dir.name, "vocab_size": vocab_size, "eos_ids": eos,
           "tokenizer_load_s": {lib.name: lib.tokenizer_s for lib in libs},
           "versions": {lib.name: lib.version for lib in libs}, "constraints": {}}
    for name, constraint, valid, invalid in CASES:
        ids = [tokenizer.encode(v, add_special_tokens=False) for v in valid]
        bad = [tokenizer.encode(v, add_special_tokens=False) for v in invalid]
        compile_s = {lib.name: [] for lib in libs}
        mask_s = {lib.name: [] for lib in libs}
        accept_s = {lib.name: [] for lib in libs}
        for r in range(rounds):
            for lib in (libs if r % 2 == 0 else libs[::-1]):
                t = time.perf_counter()
                lib.compile(constraint)
                compile_s[lib.name].append(time.perf_counter() - t)
                m = lib.matcher(constraint)
                for tok in ids[0]:
                    t = time.perf_counter()
                    lib.mask(m)
                    t1 = time.perf_counter()
                    lib.accept(m, tok)
                    t2 = time.perf_counter()
                    mask_s[lib.name].append(t1 - t)
                    accept_s[lib.name].append(t2 - t1)
        row = {"answer_tokens": len(ids[0]), "libraries": {}}
        walks = {}
        for lib in libs:
            walks[lib.name] = [walk(lib, constraint, x, eos) for x in ids]
            ms = sorted(mask_s[lib.name])
            row["libraries"][lib.name] = {
                "compile_ms": statistics.median(compile_s[lib.name]) * 1e3,
                "mask_us_median": statistics.median(ms) * 1e6,
                "mask_us_p90": ms[int(0.9 * (len(ms) - 1))] * 1e6,
                "advance_us_median": statistics.median(accept_s[lib.name]) * 1e6,
                "valid_accepted": sum(w["accepted"] == w["tokens"] and w["may_end"] for w in walks[lib.name]),
                "valid": len(ids),
                "invalid_refused": sum(refuses(lib, constraint, x) for x in bad),
                "invalid": len(bad),
                "rollback_ok": all(w["rollback_ok"] for w in walks[lib.name]),
                **forced_along(lib, constraint, ids[0], tokenizer),
            }
        if len(libs) == 2:
            a_name, b_name = libs[0].name, libs[1].name
            differ, only = [], {a_name: 0, b_name: 0}
            for wa, wb, x in zip(walks[a_name], walks[b_name], ids):
                for i, (a, b) in enumerate(zip(wa["masks"], wb["masks"])):
                    if not (a and b):
                        continue
                    in_a, in_b = _differ(a, b, vocab_size)
                    only[a_name] += bool(in_a)
                    only[b_name] += bool(in_b)
                    if in_a or in_b:
                        differ.append({"after": tokenizer.decode(x[:i]),
                                       f"only_{a_name}": [tokenizer.decode([t]) for t in in_a[:4]] + [len(in_a)],
                                       f"only_{b_name}": [tokenizer.decode([t]) for t in in_b[:4]] + [len(in_b)]})
            row["mask_positions"] = sum(len(w["masks"]) for w in walks[a_name])
            row["positions_where_only_one_allows_some"] = only
            row["differences"] = differ[:4]
        out["constraints"][name] = row
    out["unimplemented_schemas"] = {lib.name: unimplemented(lib) for lib in libs}
    out["dflash_path"] = dflash_path(libs[0].vocab, tokenizer.encode(CASES[0][2][0], add_special_tokens=False), rounds)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", action="append", type=Path,
                    help="a model folder with tokenizer and config.json (repeatable; default: the default target's)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    report = {"cpu": cpu_name(), "rounds": rounds_note(args.rounds),
              "results": [measure(d, args.rounds) for d in (args.tokenizer or [default_target_dir()])]}
    write_json_report(report, args.out, "grammar_libraries.json")
    return 0


def rounds_note(rounds: int) -> str:
    return f"{rounds} rounds, the libraries interleaved (order alternating), one thread each"


if __name__ == "__main__":
    raise SystemExit(main())
