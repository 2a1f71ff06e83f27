"""The remote backend speaks the served model's tokenizer: the tokenizer comes from what the
user gives (--target: a folder, a GGUF file's own tokenizer, a model name), and at start-up
the server's /tokenize must give the same ids for a probe text and for the probe in the
chat template; otherwise a clean bad_target, never silently wrong ids. Fake servers here
(tests/test_remote_errors.py's); a real llama-server at the end where one is built."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from dflash.chat import TOKENIZER_PROBE
from dflash.errors import DFlashError
from dflash.remote.engine import remote_engine
from tests.test_remote_errors import Fake, fake, generate, llama_tokens, smol_tokenize  # noqa: F401


def answer_two_tokens(h, body, n):
    Fake.stream(h, llama_tokens(2))


def answer_two_openai_tokens(h, body, n):
    Fake.stream(h, [{"choices": [{"index": 0, "text": f" t{i}", "token_ids": [1000 + i],
                                  "finish_reason": "length" if i == 1 else None}]} for i in range(2)] + [b"[DONE]"])


def test_an_agreeing_server_is_checked_and_serves(fake, smol_dir):  # noqa: F811
    f = fake(answer_two_tokens)
    engine = remote_engine(f.url, smol_dir)
    texts = [b["content"] for b in f.tokenize_bodies]
    assert texts[0] == TOKENIZER_PROBE and TOKENIZER_PROBE in texts[1] and "<|im_start|>" in texts[1]
    assert all(b["add_special"] is False and b["parse_special"] is True for b in f.tokenize_bodies)
    assert generate(engine, max_new_tokens=2).output_ids == [1000, 1001]


def test_an_openai_server_is_asked_in_its_dialect(fake, smol_dir):  # noqa: F811
    f = fake(answer_two_tokens, kind="openai")
    remote_engine(f.url + "/v1", smol_dir, model="fake-model")  # /tokenize is at the root, not under /v1
    assert f.tokenize_bodies[0] == {"model": "fake-model", "prompt": TOKENIZER_PROBE, "add_special_tokens": False}


def test_another_vocabulary_is_refused_at_start(fake, smol_dir, smol_tokenize):  # noqa: F811
    """The issue's case: a server running another model (other ids for the same text) and the
    default tokenizer here. Same vocabulary size, so the old guard let it through."""
    f = fake(answer_two_tokens, tokenize=lambda text: [i + 1 for i in smol_tokenize(text)])
    with pytest.raises(DFlashError) as e:
        remote_engine(f.url, smol_dir)
    assert e.value.code == "bad_target" and str(smol_dir) in e.value.message and "--target" in e.value.message
    assert f.bodies == []  # nothing was generated


def test_other_special_token_ids_are_refused(fake, smol_dir, smol_tokenize):  # noqa: F811
    """Plain text agrees, the chat markup does not (a server whose <|im_start|> is another id)."""
    def served(text):
        return [7 if i == 1 else i for i in smol_tokenize(text)]

    f = fake(answer_two_tokens, tokenize=served)
    with pytest.raises(DFlashError) as e:
        remote_engine(f.url, smol_dir)
    assert e.value.code == "bad_target" and len(f.tokenize_bodies) == 2


@pytest.mark.parametrize("kind", ["llama.cpp", "openai"])
def test_a_server_without_tokenize_gets_text_and_says_so(fake, smol_dir, caplog, kind):  # noqa: F811
    """Its tokenizer cannot be checked: the prompt goes as text (the served model's own
    tokenizer reads it; ids might be another vocabulary's), and the answer's ids are the
    server's."""
    answer = answer_two_tokens if kind == "llama.cpp" else answer_two_openai_tokens
    f = fake(answer, kind=kind, tokenize=None)
    with caplog.at_level(logging.WARNING, logger="dflash.remote"):
        engine = remote_engine(f.url, smol_dir)
    assert "has no /tokenize" in caplog.text and "as text" in caplog.text
    assert engine.status()["tokenizer_checked"] is False  # and status says so, for as long as it serves
    assert generate(engine, max_new_tokens=2).output_ids == [1000, 1001]
    sent = f.bodies[0]["prompt"]
    assert isinstance(sent, str) and "Write a haiku about databases" in sent and "<|im_start|>" in sent


def test_a_malformed_tokenize_answer_is_an_endpoint_error(fake, smol_dir):  # noqa: F811
    f = fake(answer_two_tokens, tokenize=lambda text: "no")
    with pytest.raises(DFlashError) as e:
        remote_engine(f.url, smol_dir)
    assert e.value.code == "endpoint_error"


def test_the_tokenizer_of_a_gguf_target(tmp_path, monkeypatch, fake, smol_dir):  # noqa: F811
    """--target FILE.gguf with --backend openai: the GGUF's own tokenizer (and config), saved
    once into the cache without the weights (the file's own folder, which llama.cpp also
    runs it with), agrees with the server serving that file."""
    from dflash.cli import main
    from dflash.convert.target_gguf import has_weights
    from dflash.model_files import default_target_gguf, gguf_target_dir, resolve_tokenizer

    monkeypatch.setenv("PG_DFLASH_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "served.gguf"
    try:
        os.link(default_target_gguf(), copy)  # another path than the default's: converted on its own
    except OSError:
        shutil.copy(default_target_gguf(), copy)
    folder = resolve_tokenizer(str(copy), quiet=True)
    assert folder.parent == tmp_path / "cache" / "targets" and folder == gguf_target_dir(copy)
    assert not has_weights(folder)
    assert (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file()
    assert not list(folder.glob("*.safetensors"))
    assert resolve_tokenizer(str(copy), quiet=True) == folder  # once
    f = fake(answer_two_tokens)
    assert main(["generate", "--backend", "openai", "--endpoint", f.url, "--target", str(copy),
                 "--prompt", "Hi", "--max-new-tokens", "2", "--json"]) == 0
    assert len(f.tokenize_bodies) == 2 and len(f.bodies) == 1


# --- a real llama-server --------------------------------------------------------------


@pytest.mark.slow
def test_a_real_llama_server_agrees_with_its_gguf_and_refuses_another(tmp_path):
    """llama-server serving Qwen2.5-Coder-0.5B: with the tokenizer from its GGUF the engine
    starts and answers as the server does; with the default (SmolLM2) tokenizer it refuses."""
    from dflash.bench import llamacpp
    from dflash.model_files import QWEN_CODER_05B, installed, model_gguf, resolve_tokenizer

    missing = [why for why, ok in ((f"{QWEN_CODER_05B} is not installed (dflash models {QWEN_CODER_05B})",
                                    installed(QWEN_CODER_05B)),
                                   ("llama-server is not built (make peers)", llamacpp.binary("llama-server").is_file()))
               if not ok]
    if missing:
        if os.environ.get("CI"):
            pytest.fail("; ".join(missing))
        pytest.skip("; ".join(missing))
    server = llamacpp.LlamaServer(model_gguf(QWEN_CODER_05B), threads=2, ctx=2048, log=tmp_path / "server.log",
                                  trace=False)
    try:
        engine = remote_engine(server.url, resolve_tokenizer(QWEN_CODER_05B))
        res = generate(engine, prompt="Write a Python function that adds two numbers.", max_new_tokens=24,
                       temperature=0)
        assert "def" in res.text, res.text
        from dflash.model_files import ensure_default_target

        with pytest.raises(DFlashError) as e:
            remote_engine(server.url, ensure_default_target(quiet=True))
        assert e.value.code == "bad_target"
    finally:
        server.close()
