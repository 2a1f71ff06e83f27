"""What each kind of inference server is sent, and what its answers mean.

Two dialects of the same job, a streamed completion of a prompt given as token ids:

- `LlamaCpp`: llama.cpp's `llama-server`, found by its `/props`. Its native `/completion`
  takes the ids, streams one token id per event and ends with `timings`, which carry the
  request's own drafted and accepted counts (`draft_n`, `draft_n_accepted`) when it decodes
  speculatively. The sampler chain is named (top-k, temperature, top-p, nothing else), so
  the options mean what they mean for the native engine.
- `OpenAI`: any OpenAI-compatible server (vLLM, SGLang): `/v1/completions` with the prompt
  as a token-id list (as text when it refuses that), `top_k`, `seed`, `stop_token_ids` and
  `return_token_ids` (vLLM's extensions; without token ids the answer's text is tokenised
  here). vLLM's speculative counters come from `/metrics`, read before and after a request.

`probe(endpoint, model)` tells them apart and reads what the server says about itself.
"""

from __future__ import annotations

import re

from dflash.errors import DFlashError
from dflash.remote.openai_client import Endpoint, Piece

# llama-server's seed is a uint32, and 0xFFFFFFFF means "random": keep a seed below it.
LLAMA_SEEDS = 2**32 - 1


def _ints(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise DFlashError("endpoint_error", f"the inference endpoint sent {what} that are not token ids: {value!r:.200}")
    return value


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DFlashError("endpoint_error", f"the inference endpoint sent {what} that is not text: {value!r:.200}")
    return value


class LlamaCpp:
    kind = "llama.cpp"
    path = "/completion"
    metrics = None  # per-request counts come in the answer itself
    text_fallback = False  # it always takes token ids

    def __init__(self, model: str, props: dict):
        self.model = model
        settings = props.get("default_generation_settings") or {}
        self.context_length = settings.get("n_ctx")
        self.slots = props.get("total_slots")

    def body(self, prompt_ids: list[int], opts: dict, as_text: str | None = None) -> dict:
        greedy = opts["temperature"] == 0
        body = {
            "prompt": as_text if as_text is not None else prompt_ids,
            "n_predict": opts["max_new_tokens"],
            "temperature": opts["temperature"],
            "top_k": 1 if greedy else opts["top_k"],
            "top_p": opts["top_p"],
            "min_p": 0.0,
            # the native engine's order (sampling.warp), and no sampler of llama.cpp's own
            "samplers": ["top_k", "temperature", "top_p"],
            "stream": True,
            "return_tokens": True,
        }
        if opts["seed"] is not None:
            body["seed"] = opts["seed"] % LLAMA_SEEDS
        if opts["stop"]:
            body["stop"] = list(opts["stop"])
        return body

    @staticmethod
    def tokenize_body(text: str) -> dict:
        """/tokenize: the ids of `text`, its special-token text parsed, no BOS added."""
        return {"content": text, "add_special": False, "parse_special": True}

    @staticmethod
    def parse(obj: dict) -> Piece:
        piece = Piece(ids=_ints(obj.get("tokens", []), "tokens"), text=_text(obj.get("content"), "content"))
        if "stop" not in obj:
            raise DFlashError("endpoint_error", f"llama-server sent an event without 'stop': {str(obj)[:200]}")
        if obj["stop"] is True:
            piece.finish_reason = "length" if obj.get("stop_type") == "limit" else "stop"
            timings = obj.get("timings") or {}
            piece.info = {"timings": timings, "tokens_predicted": obj.get("tokens_predicted")}
            if "draft_n" in timings:
                piece.info["speculative"] = {"drafted": int(timings["draft_n"]),
                                             "accepted": int(timings.get("draft_n_accepted", 0)),
                                             "source": "response", "pooled": False}
        return piece


class OpenAI:
    kind = "openai"
    path = "/v1/completions"
    text_fallback = True  # a server that refuses a prompt of token ids gets the text

    def __init__(self, model: str, models: dict | None, endpoint: Endpoint):
        self.model = model
        self.endpoint = endpoint
        entry = next((m for m in (models or {}).get("data", []) if isinstance(m, dict) and m.get("id") == model), {})
        self.context_length = entry.get("max_model_len")  # vLLM says it; others do not
        self.slots = None

    def body(self, prompt_ids: list[int], opts: dict, as_text: str | None = None) -> dict:
        body = {
            "model": self.model,
            "prompt": as_text if as_text is not None else prompt_ids,
            "max_tokens": opts["max_new_tokens"],
            "temperature": opts["temperature"],
            "top_p": opts["top_p"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if opts["top_k"]:
            body["top_k"] = opts["top_k"]
        if opts["seed"] is not None:
            body["seed"] = opts["seed"]
        if opts["stop"]:
            body["stop"] = list(opts["stop"])
        if opts["stop_ids"]:
            body["stop_token_ids"] = list(opts["stop_ids"])
        return body

    def tokenize_body(self, text: str) -> dict:
        """vLLM's /tokenize (SGLang's too): the served tokenizer's ids of `text`, no BOS added."""
        return {"model": self.model, "prompt": text, "add_special_tokens": False}

    @staticmethod
    def parse(obj: dict) -> Piece:
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise DFlashError("endpoint_error", f"the inference endpoint sent an event without choices: {str(obj)[:200]}")
        piece = Piece()
        for choice in choices:
            if not isinstance(choice, dict):
                raise DFlashError("endpoint_error", f"the inference endpoint sent a choice that is not an object: "
                                  f"{str(choice)[:200]}")
            piece.text += _text(choice.get("text"), "text")
            if choice.get("token_ids") is not None:
                piece.ids += _ints(choice["token_ids"], "token_ids")
            if choice.get("finish_reason") is not None:
                piece.finish_reason = "length" if choice["finish_reason"] == "length" else "stop"
        if isinstance(obj.get("usage"), dict):
            piece.info["usage"] = obj["usage"]
        return piece

    def metrics(self) -> dict | None:
        """vLLM's speculative-decoding counters, summed over its label sets; None when the
        server exposes none."""
        try:
            text = self.endpoint.get_json("/metrics")
        except DFlashError:
            return None
        return spec_counters(text) if isinstance(text, str) else None


SPEC_COUNTER = re.compile(r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)(?:_total)?(?:\{[^}]*\})?\s+"
                          r"([0-9.eE+-]+)\s*$", re.M)


def spec_counters(text: str) -> dict | None:
    """{"steps", "drafted", "accepted"} from a Prometheus text page, or None without them."""
    found = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    seen = False
    for name, value in SPEC_COUNTER.findall(text):
        found[name] += float(value)
        seen = True
    if not seen:
        return None
    return {"steps": int(found["drafts"]), "drafted": int(found["draft_tokens"]),
            "accepted": int(found["accepted_tokens"])}


def probe(endpoint: Endpoint, model: str | None):
    """The dialect of the server at `endpoint`, with the model it serves (`model`, or the
    first it lists). Raises endpoint_unavailable when nothing answers."""
    props = endpoint.get_json("/props")
    models = endpoint.get_json("/v1/models")
    models = models if isinstance(models, dict) else None
    listed = [m.get("id") for m in (models or {}).get("data", []) if isinstance(m, dict) and m.get("id")]
    if model is None:
        if not listed:
            raise DFlashError("bad_params", f"the inference endpoint {endpoint.url} lists no model: pass --model NAME")
        model = listed[0]
    elif listed and model not in listed and not isinstance(props, dict):
        raise DFlashError("bad_params", f"the inference endpoint {endpoint.url} serves {', '.join(listed)}, "
                          f"not {model}")
    if isinstance(props, dict) and "default_generation_settings" in props:
        return LlamaCpp(model, props), models
    return OpenAI(model, models, endpoint), models


TOKENIZE_PATH = "/tokenize"  # llama-server's and vLLM's (at the server's root, not under /v1)


def served_ids(endpoint: Endpoint, dialect, text: str) -> list[int] | None:
    """The served model's ids of `text` by the server's /tokenize; None when it has none."""
    answer = endpoint.post_json(TOKENIZE_PATH, dialect.tokenize_body(text))
    if answer is None:
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    return _ints(tokens, "/tokenize tokens")


def vocab_size(models: dict | None, model: str) -> int | None:
    """The vocabulary the server's model has, where it says (llama-server's /v1/models meta)."""
    for m in (models or {}).get("data", []):
        if isinstance(m, dict) and m.get("id") == model and isinstance(m.get("meta"), dict):
            return m["meta"].get("n_vocab")
    return None
