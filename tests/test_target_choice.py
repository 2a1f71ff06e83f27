"""Choosing the target backend (dflash.loading.fastest_engine, dflash.engine.target.fastest):
the backend that decodes fastest with block length auto wins, which is not always the one
with the fastest plain step; the choice is cached and spot-checked, and re-measured when the
machine got slower. The prices here are given (a busy test machine would make timed ones
arbitrary); the backends are tiny real targets."""

import pytest

from dflash.engine.target import fastest


def _prices(plain, verify2, verify4, draft):
    return {"verify": {"1": plain, "2": verify2, "4": verify4}, "draft": {"2": draft, "4": draft}}


def test_a_backend_that_verifies_cheaply_wins_when_drafts_are_cheap():
    acc = fastest.default_acceptance()
    llamacpp_like = _prices(0.016, 0.032, 0.043, 0.004)  # the cheapest plain step, every row paid in full
    ort_like = _prices(0.017, 0.018, 0.024, 0.003)  # a dearer plain step, rows nearly free
    assert fastest.expected_rate(ort_like, acc) > fastest.expected_rate(llamacpp_like, acc)
    # ... and the cheapest plain step wins when drafting costs more than it brings
    dear = {k: _prices(*v[:3], 0.040) for k, v in {"a": (0.016, 0.032, 0.043), "b": (0.020, 0.021, 0.028)}.items()}
    assert fastest.expected_rate(dear["a"], acc) == pytest.approx(1 / 0.016)
    assert fastest.expected_rate(dear["a"], acc) > fastest.expected_rate(dear["b"], acc)
    record = fastest.remember(None, {"k": 1}, {"llamacpp": llamacpp_like, "ort": ort_like})
    assert record["choice"] == "ort" and set(fastest.summary(record)["prices_ms"]) == {"llamacpp", "ort"}
    # A typical request also prefills its prompt: a backend whose decode is a little faster but
    # whose prefill is far slower loses.
    slow_prefill = {**dear["a"], "prefill": {"128": 0.9}}
    fast_prefill = {**dear["b"], "prefill": {"128": 0.3}}
    assert fastest.expected_rate(slow_prefill, acc) > fastest.expected_rate(fast_prefill, acc)
    assert fastest.remember(None, {"k": 2}, {"a": slow_prefill, "b": fast_prefill})["choice"] == "b"


def test_a_length_timed_dearer_than_a_longer_one_takes_the_longer_ones_price():
    from dflash.engine.costs import longer_never_cheaper

    assert longer_never_cheaper({"2": 0.0144, "4": 0.0065}) == {"2": 0.0065, "4": 0.0065}
    assert longer_never_cheaper({"1": 0.012, "2": 0.019, "4": 0.031, "8": 0.028}) == \
        {"1": 0.012, "2": 0.019, "4": 0.028, "8": 0.028}
    rising = {"1": 0.01, "2": 0.02, "4": 0.04}
    assert longer_never_cheaper(rising) == rising and list(longer_never_cheaper({"4": 1.0, "2": 2.0})) == ["2", "4"]
    assert longer_never_cheaper({}) == {}


def test_a_serving_worker_weighs_a_step_of_several_callers():
    """A backend a little slower for a lone request but far cheaper for a step of
    BUSY_CALLERS sequences (ONNX Runtime against llama.cpp on Qwen2.5-Coder-1.5B) wins for
    `dflash serve`, not for a lone request; prices without that step decide as before."""
    acc = fastest.default_acceptance()
    busy = str(fastest.BUSY_CALLERS)
    llamacpp_like = {**_prices(0.034, 0.061, 0.095, 0.0), "prefill": {"128": 1.1}}
    ort_like = {**_prices(0.050, 0.054, 0.083, 0.0), "prefill": {"128": 1.1}}
    llamacpp_like["verify"][busy], ort_like["verify"][busy] = 0.233, 0.116
    measured = {"llamacpp": llamacpp_like, "ort": ort_like}
    assert fastest.request_seconds(llamacpp_like, acc) < fastest.request_seconds(ort_like, acc)
    assert fastest.remember(None, {"k": 1}, measured)["choice"] == "llamacpp"
    record = fastest.remember(None, {"k": 1}, measured, serving=True)
    assert record["choice"] == "ort"
    assert record["busy_request_s"]["ort"] == pytest.approx(1.1 + fastest.NEW_TOKENS * 0.116 / fastest.BUSY_CALLERS)
    assert "callers" in fastest.summary(record)["weighed"]
    for prices in measured.values():
        del prices["verify"][busy]
    assert fastest.remember(None, {"k": 1}, measured, serving=True)["choice"] == "llamacpp"
    # Passing a candidate over is bounded by the same measure (a busy step costs at least a
    # plain one): a plain step that rules a backend out for a lone request may not for a worker.
    lone_bound = fastest.ruled_out_above(measured, acc)
    assert fastest.ruled_out_above(measured, acc, serving=True) > lone_bound


def test_free_drafts_weigh_in_the_choice():
    """The defect this fixes (SmolLM2 on a Zen 3, its measured prices): with drafts at the
    model drafter's price llama.cpp's cheaper plain step made it a near winner, yet with free
    drafts (suffix chains, the tokens a grammar forces: most kept drafts on a CPU) the
    Q4_1 graph, which verifies 2 rows for one and prefills 2.3x as fast, is 30 % faster. The
    choice takes the least worst ratio over the workloads, so a backend a little slower at
    plain steps but far faster where drafts are free wins; one far slower at plain steps does
    not (the worst ratio is taken, not the sum)."""
    acc = fastest.default_acceptance()
    llamacpp = {"verify": {"1": 0.0113, "2": 0.0194, "4": 0.0317}, "draft": {"2": 0.0065, "4": 0.0065},
                "prefill": {"128": 0.649}}
    q41 = {"verify": {"1": 0.0153, "2": 0.0155, "4": 0.0207}, "draft": {"2": 0.0065, "4": 0.0065},
           "prefill": {"128": 0.284}}
    assert fastest.request_seconds(llamacpp, acc) < fastest.request_seconds(q41, acc)  # paid drafts: a tie
    times = {n: fastest.workload_seconds(p, acc, False) for n, p in {"llamacpp": llamacpp, "q41": q41}.items()}
    assert times["llamacpp"]["plain"] < times["q41"]["plain"] and times["q41"]["free"] < 0.8 * times["llamacpp"]["free"]
    record = fastest.remember(None, {"k": 1}, {"llamacpp": llamacpp, "q41": q41})
    assert record["choice"] == "q41" and record["worst_ratio"]["q41"] < record["worst_ratio"]["llamacpp"]
    assert set(fastest.summary(record)["workload_s"]["q41"]) == set(fastest.WORKLOADS)
    # Twice the plain step, rows up to 4 free: faster with free drafts, but half as fast without.
    slow_plain = {**q41, "verify": {"1": 0.022, "2": 0.022, "4": 0.022}}
    both = {"llamacpp": llamacpp, "q41": slow_plain}
    assert fastest.workload_seconds(slow_plain, acc, False)["free"] < times["llamacpp"]["free"]
    assert fastest.choose(both, acc, False) == "llamacpp"
    # Plain decoding's workload prices no draft; a free draft is priced at nothing.
    assert fastest.workload("plain", acc) == ([0.0] * len(acc), False) and fastest.workload("free", acc)[1] is False
    assert times["q41"]["plain"] == pytest.approx(0.284 + fastest.NEW_TOKENS * 0.0153)


@pytest.fixture
def two_tiny_backends(monkeypatch):
    """Two builders of tiny real targets, with the prices spot_prices will 'measure' for each."""
    from dflash.engine import costs
    from dflash.loading import _Builder
    from tests.conftest import make_tiny_target

    prices = {"slow_plain": _prices(0.010, 0.020, 0.040, 0.002), "fast_verify": _prices(0.012, 0.0125, 0.014, 0.002)}
    built = []

    def builder(name):
        def make():
            t = make_tiny_target(seed=len(built))
            t.backend = name
            built.append(name)
            return t
        return _Builder(make, None)

    monkeypatch.setattr(costs, "spot_prices", lambda engine: prices[engine.target.backend])
    # the plain step that may rule a candidate out: its given price, not a timing of a busy machine
    monkeypatch.setattr(fastest, "step_seconds",
                        lambda target, layers, repeats=fastest.REPEATS: prices[target.backend]["verify"]["1"])
    return {name: builder(name) for name in prices}, prices, built


def _engine_over(target, draft_dtype=None):
    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine
    from tests.conftest import tiny_drafter_config

    return Engine(target, init_random_drafter(tiny_drafter_config(), seed=1), "tiny", draft_dtype=draft_dtype)


def test_the_choice_is_measured_cached_and_spot_checked(tmp_path, two_tiny_backends, monkeypatch):
    from dflash.loading import fastest_engine

    builders, prices, built = two_tiny_backends
    first = fastest_engine(builders, _engine_over, "tiny", tmp_path)
    assert first.target.backend == "fast_verify" and first.target.selection["how"] == "measured at start"
    assert sorted(built) == ["fast_verify", "slow_plain"]  # both measured, the winner's engine kept (not built again)
    rates = first.target.selection["expected_tokens_per_s"]
    assert rates["fast_verify"] > rates["slow_plain"]
    # A later start takes the cached choice after timing its plain step once ...
    monkeypatch.setattr(fastest, "step_seconds", lambda target, layers, repeats=5: 0.011)
    built.clear()
    again = fastest_engine(builders, _engine_over, "tiny", tmp_path)
    assert again.target.selection["how"].startswith("measured earlier") and built == ["fast_verify"]
    # ... unless that step is now STALE times slower than when the choice was made: measure again.
    monkeypatch.setattr(fastest, "step_seconds", lambda target, layers, repeats=5: 0.012 * fastest.STALE * 1.1)
    built.clear()
    third = fastest_engine(builders, _engine_over, "tiny", tmp_path)
    assert third.target.selection["how"] == "measured at start" and "slow_plain" in built
    # A serving worker's choice is its own (another objective): not the lone request's cached one.
    serving = fastest_engine(builders, _engine_over, "tiny", tmp_path, serving=True)
    assert serving.target.selection["how"] == "measured at start" and "weighed" in serving.target.selection


def test_a_later_candidate_can_hand_the_choice_to_an_earlier_one(tmp_path, two_tiny_backends, monkeypatch):
    """The least worst ratio depends on every candidate (each may set a workload's best): after
    `a` and `b`, `a` leads; `c`, fastest with drafts, makes `b` the least bad everywhere. `b`'s
    engine was let go when it was priced, so it is built again, and the choice is served."""
    from dflash.loading import fastest_engine

    builders, _, built = two_tiny_backends

    def prices(plain_s, free_s):  # no prefill, drafts free: a plain time and a drafted one
        return {"verify": {"1": plain_s / 128, "2": free_s * 1.5 / 128, "4": free_s * 3 / 128},
                "draft": {"2": 0.0, "4": 0.0}}

    given = {"a": prices(1.0, 0.95), "b": prices(1.12, 0.9), "c": prices(1.2, 0.8)}
    acc = fastest.default_acceptance()
    assert fastest.choose({k: given[k] for k in "ab"}, acc, False) == "a" and fastest.choose(given, acc, False) == "b"
    monkeypatch.setattr("dflash.engine.costs.spot_prices", lambda engine: given[engine.target.backend])
    monkeypatch.setattr(fastest, "step_seconds", lambda target, layers, repeats=5: given[target.backend]["verify"]["1"])
    make_tiny = builders["slow_plain"].make

    def named(name):
        def make():
            t = make_tiny()
            built[-1] = t.backend = name
            return t
        return type(builders["slow_plain"])(make, None)

    engine = fastest_engine({n: named(n) for n in "abc"}, _engine_over, "tiny", tmp_path)
    assert engine.target.backend == "b" and built == ["a", "b", "c", "b"]


def test_a_candidate_whose_plain_step_rules_it_out_is_passed_over(tmp_path, two_tiny_backends, monkeypatch):
    """Once one backend is priced, another whose plain step alone puts its best possible
    request beyond SLACK times the best so far is neither built into an engine (no draft
    choice) nor priced in full; `status` says why. One just inside the bound is priced."""
    from dflash.loading import _Builder, fastest_engine

    builders, prices, built = two_tiny_backends
    bound = fastest.ruled_out_above(prices, fastest.default_acceptance())
    plain = {"hf": 1.01 * bound}  # just beyond: passed over
    make_tiny = builders["slow_plain"].make

    def hf():
        t = make_tiny()
        built[-1] = t.backend = "hf"
        return t

    monkeypatch.setattr(fastest, "step_seconds", lambda target, layers, repeats=5: plain.get(target.backend, 0.001))
    priced = []
    monkeypatch.setattr("dflash.engine.costs.spot_prices",
                        lambda engine: priced.append(engine.target.backend) or prices.get(engine.target.backend,
                                                                                           prices["slow_plain"]))
    engine = fastest_engine({"hf": _Builder(hf, None), **builders}, _engine_over, "tiny", tmp_path)
    sel = engine.target.selection
    assert engine.target.backend == "fast_verify" and sorted(priced) == ["fast_verify", "slow_plain"]
    assert "hf" in built and set(sel["prices_ms"]) == {"fast_verify", "slow_plain"}
    assert "a request takes at least" in sel["passed_over"]["hf"]
    # Just inside the bound it is priced in full (and loses on its prices).
    plain["hf"] = 0.99 * bound
    priced.clear()
    engine = fastest_engine({"hf": _Builder(hf, None), **builders}, _engine_over, "tiny", tmp_path / "again")
    assert "hf" in priced and "passed_over" not in engine.target.selection


def test_when_no_candidate_can_run_the_drafter_the_first_reason_is_the_error(tmp_path, two_tiny_backends):
    """Under auto a candidate that fails to build is skipped; when all fail (a drafter that
    fits no backend's target) the start fails with the first one's clean error."""
    from dflash.errors import DFlashError
    from dflash.loading import fastest_engine

    builders, _, _ = two_tiny_backends

    def refuse(target, draft_dtype=None):
        raise DFlashError("incompatible_drafter", f"does not fit {target.backend}")

    with pytest.raises(DFlashError) as err:
        fastest_engine(builders, refuse, "tiny", tmp_path)
    assert err.value.code == "incompatible_drafter" and err.value.message == "does not fit slow_plain"
    assert not list(tmp_path.iterdir())  # nothing chosen, nothing cached


def test_a_backend_asked_for_that_cannot_run_is_a_clean_error(smol_dir):
    from dflash.errors import DFlashError
    from dflash.loading import load_target, target_builders

    with pytest.raises(DFlashError) as err:
        load_target(smol_dir, "llamacpp", gguf=None)
    assert err.value.code == "bad_target" and "GGUF" in err.value.message
    builders = target_builders(smol_dir, device="cpu", dtype="bfloat16")
    assert builders["hf"].why_not is None and "float32" in builders["ort"].why_not
    assert "float32" in builders["ort-q4_1"].why_not
    with pytest.raises(DFlashError) as err:
        load_target(smol_dir, "ort", dtype="bfloat16")
    assert err.value.code == "bad_target"


@pytest.mark.slow
def test_auto_on_this_machine_takes_a_measured_backend(tmp_path):
    """The real thing: every backend that runs here measured with the shipped drafter (or
    passed over: on a CPU the transformers reference's plain step rules it out)."""
    from dflash.loading import load_engine
    from dflash.model_files import default_drafter_dir, default_target_gguf, ensure_default_target

    engine = load_engine(ensure_default_target(quiet=True), default_drafter_dir()[0], cost_dir=tmp_path,
                         target_gguf=default_target_gguf())
    sel = engine.target.selection
    times, ratios = sel["request_s"], sel["worst_ratio"]  # the choice: the least worst ratio
    assert sel["how"] == "measured at start" and engine.target.backend == min(ratios, key=ratios.get)
    assert {"hf", "llamacpp", "ort", "ort-q4_1"} >= set(times) and len(times) >= 2
    assert set(sel["expected_tokens_per_s"]) == set(times)
    # Every candidate priced, or passed over for a plain step that rules it out.
    assert set(times) | set(sel.get("passed_over", {})) == {"hf", "llamacpp", "ort", "ort-q4_1"}


def test_backends_are_priced_at_a_typical_requests_context(monkeypatch):
    """A step's price grows with the cached tokens at a rate that differs by backend, so the
    choice times its steps at the context a typical request's steps meet on average, and the
    spot check of a cached choice at the same one; a target with less room, at what fits."""
    from dflash.engine import costs
    from tests.conftest import make_tiny_target

    engine = _engine_over(make_tiny_target(context=512))
    calls = []
    forward = engine.target.forward_batch

    def spy(rows, layers=()):
        calls.append([len(r.ids) for r in rows])
        return forward(rows, layers)

    monkeypatch.setattr(engine.target, "forward_batch", spy)
    prices = costs.spot_prices(engine, repeats=2)
    assert costs.TYPICAL_CONTEXT > costs.PREFILL_TOKENS and calls[0] == [costs.TYPICAL_CONTEXT]
    assert set(prices["verify"]) == {"1", "2", "4", str(costs.BUSY_CALLERS)}  # a step of several callers too
    assert [costs.BUSY_CALLERS] in calls
    calls.clear()
    fastest.step_seconds(engine.target, repeats=2)
    assert calls[0] == [costs.TYPICAL_CONTEXT] and all(c == [1] for c in calls[1:])
    small = make_tiny_target(context=96)
    assert costs.bench_context(small, costs.TYPICAL_CONTEXT, 8) == 96 - 8 - 1


def test_the_cpu_is_named_with_its_family_and_instruction_sets():
    """Cached prices and benchmark records name the CPU by more than its model name: VMs here
    call a Zen 3 (AVX2 only) and a Zen 5 (AVX-512) both "AMD EPYC"."""
    from pathlib import Path

    from dflash.engine.costs import ISA_FLAGS, cpu_name

    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.is_file() else ""
    if "cpu family" not in text:
        pytest.skip("no /proc/cpuinfo with a cpu family here")
    flags = set(next(line for line in text.splitlines() if line.startswith("flags")).split(":", 1)[1].split())
    name = cpu_name()
    assert "family" in name
    for flag in ISA_FLAGS:
        assert (f" {flag}" in name) == (flag in flags), (flag, name)
