"""ASGI middleware `tpu-models serve` adds to vLLM's API server (`--middleware`).

vLLM answers a body that is not UTF-8 with a bare "There was an error parsing
the body"; this names what is wrong, in the OpenAI error format, before the
request reaches vLLM. JSON between systems must be UTF-8 (RFC 8259 section 8.1).
"""

import json


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
    body = json.dumps({"error": {"message": message, "type": "BadRequestError",
                                 "param": None, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
