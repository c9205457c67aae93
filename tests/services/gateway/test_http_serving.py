"""The HTTP API to browsers (CORS) and over TLS, with vLLM's flags: any origin by default, a
preflight answered before the API key is asked for and a refusal a page can read; HTTPS that
the `openai` client completes over, checking the gateway's certificate."""
from __future__ import annotations

import ssl

import httpx
import openai
import pytest

from services.common.settings import ConfigError
from services.gateway.config import GatewayConfig
from tests.services.gateway.mesh import GatewayProcess

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def gateway(mesh, *flags: str) -> GatewayProcess:
    return GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                          [d.address for d in mesh.decode], "--local-prefill-max-tokens", "0", *flags)


def test_any_origin_may_call_by_default_as_vllms(mesh):
    url = f"{mesh.gateway.base_url}/v1/completions"
    preflight = httpx.options(url, headers={"Origin": "https://page.example", **PREFLIGHT}, timeout=10)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    answer = httpx.post(url, headers={"Origin": "https://page.example"}, timeout=30,
                        json={"model": mesh.model_name, "prompt": "The quick brown fox", "max_tokens": 2})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_are_served_before_the_key_and_others_are_not(mesh):
    keyed = gateway(mesh, "--api-key", "sk-page", "--allowed-origins", '["https://app.example"]')
    try:
        url = f"{keyed.base_url}/v1/chat/completions"
        allowed = httpx.options(url, headers={"Origin": "https://app.example", **PREFLIGHT}, timeout=10)
        assert allowed.status_code == 200  # no key in a preflight, and none asked for
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(url, headers={"Origin": "https://other.example", **PREFLIGHT}, timeout=10)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # The page reads why it was refused: the 401 carries the CORS header.
        body = {"model": mesh.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused = httpx.post(url, headers={"Origin": "https://app.example"}, json=body, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
        served = httpx.post(url, headers={"Origin": "https://app.example", "Authorization": "Bearer sk-page"},
                            json=body, timeout=30)
        assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        assert keyed.terminate() == 0
    mesh.assert_decode_pools_free()


def test_the_openai_client_completes_over_https_checking_the_certificate(mesh, self_signed_certificate):
    key, cert = self_signed_certificate
    tls = gateway(mesh, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    try:
        assert tls.base_url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as checked, openai.OpenAI(
                base_url=f"{tls.base_url}/v1", api_key="unused", max_retries=0, http_client=checked) as client:
            answer = client.completions.create(model=mesh.model_name, prompt="The quick brown fox", max_tokens=3,
                                               temperature=0, stream=True)
            assert "".join(chunk.choices[0].text for chunk in answer if chunk.choices)
        with pytest.raises(httpx.ConnectError):  # a certificate no CA the client knows signed
            httpx.get(f"{tls.base_url}/health", timeout=10)
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP is not served on the port
            httpx.get(f"http://{tls.http_address}/health", timeout=10)
    finally:
        assert tls.terminate() == 0
    mesh.assert_decode_pools_free()


def test_tls_and_cors_settings_are_checked_as_the_gateway_starts(tiny_demo_model, self_signed_certificate,
                                                                 tmp_path):
    key, cert = self_signed_certificate
    base = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:9", "--prefill", "127.0.0.1:9",
            "--decode", "127.0.0.1:9"]
    (tmp_path / "junk.pem").write_text("not a certificate")
    for flags, named in ((["--ssl-keyfile", str(key)], "--ssl-keyfile and --ssl-certfile go together"),
                         (["--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "junk.pem")], "junk.pem"),
                         (["--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-cert-reqs", "2"],
                          "give --ssl-ca-certs"),
                         (["--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be 0")):
        with pytest.raises(ConfigError, match=named):
            GatewayConfig.from_args([*base, *flags], env={})
    with pytest.raises(SystemExit):
        GatewayConfig.from_args([*base, "--allowed-origins", "https://a.example"], env={})  # not a JSON list
    config = GatewayConfig.from_args([*base], env={"BATON_GATEWAY_ALLOWED_ORIGINS": '["https://a.example"]'})
    assert config.http_serving.allowed_origins == ("https://a.example",) and not config.http_serving.is_tls
