"""ASGI middleware `tpu-models serve` adds to vLLM's API server (`--middleware`).

TpuModels (the one passed): both below, as one --middleware (vLLM warns about a repeated flag).

ReadyLine: one log line once the server is up, with what a newcomer asks first.

RequireUtf8Body: vLLM answers a body that is not UTF-8 with a bare "There was an error parsing
the body"; this names what is wrong, in the OpenAI error format, before the
request reaches vLLM. JSON between systems must be UTF-8 (RFC 8259 section 8.1).
"""

import json
import os

# Where `tpu-models serve` told vLLM to listen (vLLM's app does not know its own URL).
URL_ENV = "TPU_MODELS_URL"


class TpuModels:

    def __init__(self, app):
        self.app = ReadyLine(LostHost(RequireUtf8Body(app)))

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)


class ReadyLine:
    """Logs "tpu-models: ready: MODEL (DTYPE, PLATFORM, attention KERNEL[, Qwix TYPES][,
    KV cache DTYPE]), KV cache N tokens, C requests at --max-model-len L, URL" when the
    API server's start-up ends."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def watch(message):
            if message["type"] == "lifespan.startup.complete":
                _log_ready(scope["app"].state)
            await send(message)

        await self.app(scope, receive, watch)


def _log_ready(state) -> None:
    from tpu_inference.logger import init_logger

    from tpu_models import host
    from tpu_models.multihost import serving_across_hosts
    from tpu_models.precompilation import background_buckets
    config = state.vllm_config
    model, cache = config.model_config, config.cache_config
    tokens, concurrency = cache.kv_cache_size_tokens, cache.kv_cache_max_concurrency
    capacity = (f"KV cache {tokens:,} tokens, {concurrency:.2f} requests at --max-model-len "
                f"{model.max_model_len:,}" if tokens is not None and concurrency is not None
                else "KV cache size unknown")
    platform = host.host_platform() or "tpu"
    background = ("" if not background_buckets(config) else
                  "; the other token buckets compile when a step first meets them"
                  if serving_across_hosts() else
                  "; the other token buckets compile in the background (meanwhile a step pads "
                  "to the next compiled one)")
    init_logger("tpu_models.ready").info(
        "tpu-models: ready: %s (%s), %s, %s%s", model.served_model_name,
        ", ".join([str(model.dtype).removeprefix("torch."), platform,
                   f"attention {host.attention_mode()}", *_quantization(config),
                   *_hosts()]), capacity,
        os.environ.get(URL_ENV, "see 'Starting vLLM server on' above"), background)


def _hosts() -> list[str]:
    """Where the engine runs across hosts (tpu-inference's Ray executor), or its
    data-parallel replicas on local hosts (vLLM's Ray backend): how many."""
    from tpu_models import multihost
    hosts = os.environ.get(multihost.HOSTS_ENV)
    if multihost.serving_across_hosts():
        return [f"across {hosts} hosts (Ray)" if hosts else "across hosts (Ray)"]
    if multihost.local_hosts():
        return [f"replicas on {multihost.local_hosts()} local hosts (Ray)"]
    return []


def _quantization(config) -> list[str]:
    """What --quant and --kv-cache-dtype changed: the Qwix rules' types, the cache's."""
    rules = ((config.additional_config or {}).get("quantization") or {}).get("qwix", {}).get(
        "rules", [])
    kinds = sorted({f"{what} {rule[f'{what}_qtype']}" for rule in rules
                    for what in ("weight", "act") if rule.get(f"{what}_qtype")})
    described = [f"Qwix {', '.join(kinds)}"] if kinds else []
    if config.cache_config.cache_dtype not in (None, "auto"):
        described.append(f"KV cache {config.cache_config.cache_dtype}")
    return described


class LostHost:
    """Across hosts, a server error after a host was lost says which host: vLLM's own
    500 reads "The server had an error while processing your request"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        from tpu_models import multihost
        if scope["type"] != "http" or not multihost.serving_across_hosts():
            return await self.app(scope, receive, send)
        held = []

        async def naming(message):
            if message["type"] == "http.response.start" and message["status"] >= 500:
                if lost := multihost.lost_message():
                    held.append(lost)
                    return await _error(send, message["status"], "ServiceUnavailableError",
                                        f"tpu-models: {lost}; the server is stopping")
            if not held:
                await send(message)

        await self.app(scope, receive, naming)


class RequireUtf8Body:

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await _bad_request(send, f"request body is not valid UTF-8: byte "
                                            f"0x{body[e.start]:02x} at offset {e.start}")
        await self.app(scope, _replay([{"type": "http.request", "body": body,
                                        "more_body": False}], receive), send)


def _replay(messages, receive):
    """The body we read, then the real channel (vLLM watches it for disconnects)."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


async def _bad_request(send, message: str) -> None:
    await _error(send, 400, "BadRequestError", message)


async def _error(send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind,
                                 "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
