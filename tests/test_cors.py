"""CORS as vLLM's server answers it: by default a page of any origin may call the API from a browser (its preflight is
answered without an API key), and `--allowed-origins` narrows that. Real HTTP on 127.0.0.1, the built-in model."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from nanoref import LLM  # noqa: E402
from nanoref.serving.async_llm import AsyncLLM  # noqa: E402

from .helpers import SERVER_TIMEOUT as TIMEOUT  # noqa: E402
from .helpers import running_server  # noqa: E402

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"model": "m", "prompt": "Beautiful is", "max_tokens": 2}


def engine() -> AsyncLLM:
    return AsyncLLM(LLM(device="cpu", num_kvcache_blocks=64), owns_llm=True)


def test_any_origin_may_call_by_default_and_its_preflight_needs_no_key():
    origin = {"Origin": "http://localhost:3000"}
    with running_server(engine(), "m", api_key="sesame") as server:
        url = f"{server.url}/v1/completions"
        preflight = httpx.options(url, headers={**origin, **PREFLIGHT}, timeout=TIMEOUT)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        answered = httpx.post(url, json=BODY, headers={**origin, "Authorization": "Bearer sesame"}, timeout=TIMEOUT)
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "*"
        refused = httpx.post(url, json=BODY, headers=origin, timeout=TIMEOUT)  # (the page can read why: no key)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_narrows_who_may_call():
    with running_server(engine(), "m", allowed_origins=["http://app.example"]) as server:
        url = f"{server.url}/v1/completions"
        ok = httpx.options(url, headers={"Origin": "http://app.example", **PREFLIGHT}, timeout=TIMEOUT)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(url, headers={"Origin": "http://evil.example", **PREFLIGHT}, timeout=TIMEOUT)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        answered = httpx.post(url, json=BODY, headers={"Origin": "http://evil.example"}, timeout=TIMEOUT)
        assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers


def test_bad_cors_settings_are_named(monkeypatch, capsys):
    from nanoref.serve import main
    from nanoref.serving.api_server import build_app

    with pytest.raises(ValueError, match="allowed_origins must be a list of strings"):
        build_app(object.__new__(AsyncLLM), "m", allowed_origins="*")
    assert main(["--device", "cpu", "--port", "0", "--allowed-origins", "*"]) == 2
    assert "--allowed-origins is not valid JSON" in capsys.readouterr().err
    assert main(["--device", "cpu", "--port", "0", "--allowed-methods", '"GET"']) == 2
    assert "--allowed-methods must be a JSON list of strings" in capsys.readouterr().err
