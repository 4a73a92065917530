"""Bad requests get an HTTP 4xx with a clear message, and the server keeps serving;
security defaults (API key, loopback); a small soak run (benchmarks/soak.py)."""

import json

import psutil
import pytest
import requests

from tpu_models.benchmarks import soak
from tpu_models.server.serve import DEFAULT_NAME

pytestmark = pytest.mark.e2e
MAX_MODEL_LEN = 256  # the demo_server fixture's --max-model-len

# name -> (path, body, words the error message must contain)
EXPECTED = {
    "prompt over max-model-len": "maximum context length is 256",
    "max_tokens 0": "max_tokens must be at least 1",
    "max_tokens over max-model-len": "cannot be greater than max_model_len",
    "unknown model": "does not exist",
    "invalid JSON": "JSON",
    "invalid schema": "Grammar error",
    "non-UTF-8 body": "not valid UTF-8: byte 0xff",
    "empty prompt": "non-empty",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_request_gets_4xx_and_server_keeps_serving(demo_server, name):
    path, body = soak.malformed_requests(DEFAULT_NAME, MAX_MODEL_LEN)[name]
    response = requests.post(demo_server.url + path, data=body, timeout=60, headers={
        **demo_server.headers(), "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    message = json.dumps(response.json())
    assert EXPECTED[name] in message, message
    reply = demo_server.client().completions.create(model=DEFAULT_NAME, prompt="Bob is 30",
                                                    max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_api_key_is_required(demo_server):
    body = {"model": DEFAULT_NAME, "prompt": "hi", "max_tokens": 2}
    assert requests.post(f"{demo_server.url}/v1/completions", json=body,
                         timeout=30).status_code == 401
    assert requests.post(f"{demo_server.url}/v1/completions", json=body, timeout=30,
                         headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.post(f"{demo_server.url}/v1/completions", json=body, timeout=30,
                         headers=demo_server.headers()).status_code == 200


def test_listens_on_loopback_only(demo_server):
    server = psutil.Process(demo_server.process.pid)
    listening = {c.laddr for p in [server, *server.children(recursive=True)]
                 for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", demo_server.port) in listening
    assert all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening


def test_soak_small(demo_server):
    report = soak.run(demo_server.url, api_key=demo_server.api_key, model=DEFAULT_NAME,
                      server_pid=demo_server.process.pid, requests=150, concurrency=48, rounds=3,
                      max_tokens=16, max_model_len=MAX_MODEL_LEN, time_limit=100)
    soak.print_report(report)
    assert report["skipped"] == 0
    assert soak.passed(report), report["errors"]
    assert report["disconnected"] > 0 and report["rejected"] > 0
    # Memory settles: the last round adds little (the first warms caches).
    assert report["rss_growth_last_round"] < 0.05, report["rss_bytes_per_round"]


def test_soak_counts_a_dropped_stream_that_finished_first_as_neither():
    """A stream the client meant to drop may end (end of text) before it hangs up: the
    run still passes when every stream and plain completion completed."""
    done = [soak.Outcome("stream", "completed", 0.5, 0.1), soak.Outcome("plain", "completed", 0.4),
            soak.Outcome("disconnect", "completed", 0.3, 0.1),
            soak.Outcome("disconnect", "disconnected", 0.2, 0.1)]
    assert soak.passed(soak.summarize(done, [1, 1], 1.0, True, 4))
    failed = done + [soak.Outcome("stream", "failed", detail="boom")]
    assert not soak.passed(soak.summarize(failed, [1, 1], 1.0, True, 4))
