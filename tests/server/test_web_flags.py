"""vLLM's web-facing server flags: CORS (``--allowed-origins`` ...), ``--root-path``, TLS
(``--ssl-keyfile`` ...), ``--enable-request-id-headers`` and ``--max-logprobs``, on a real server
(``engine.server.launcher.ApiServer`` in a thread) and through the command line's checks."""

from __future__ import annotations

import datetime
import ssl

import httpx
import pytest
from server_harness import API_KEY, RunningServer, engine_config

from engine.config import ConfigError
from engine.server.app import ServerOptions
from engine.server.launcher import LaunchOptions


def _factory(model_dir, **overrides):
    from engine.engine_core.core import EngineCore

    return lambda: EngineCore.from_config(engine_config(model_dir, **overrides))


def _launch(**kw) -> LaunchOptions:
    return LaunchOptions(
        port=0, log_stats_interval=0.0, access_log=False, exit_on_engine_death=False, **kw
    )


@pytest.fixture(scope="module")
def web_server(tiny_model_dir):
    options = ServerOptions(
        api_keys=[API_KEY],
        allowed_origins=["https://app.example"],
        enable_request_id_headers=True,
    )
    with RunningServer(_factory(tiny_model_dir), options, _launch(root_path="/llm")) as server:
        yield server


def test_cors_preflight_and_answers_for_an_allowed_origin_only(web_server):
    url = web_server.base_url + "/v1/models"
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(url, headers=preflight)
    assert r.status_code == 200  # answered before the API-key check
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    # A refused request (no key) still carries the header, so the page can read the 401.
    r = httpx.get(url, headers={"Origin": "https://app.example"})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(url, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(url, headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400


def test_no_cors_headers_unless_origins_are_given(server):
    r = httpx.get(server.base_url + "/health", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert "x-request-id" not in r.headers


def test_request_id_headers(web_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(web_server.base_url + "/v1/models", headers={**auth, "X-Request-Id": "abc-1"})
    assert r.headers["x-request-id"] == "abc-1"
    a = httpx.get(web_server.base_url + "/v1/models", headers=auth).headers["x-request-id"]
    b = httpx.get(web_server.base_url + "/health").headers["x-request-id"]
    assert len(a) == 32 and a != b
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", web_server.base_url + "/v1/completions", json=body, headers=auth, timeout=60
    ) as r:
        assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32
        assert "data: [DONE]" in r.read().decode()


def test_root_path(web_server):
    """The proxy strips the prefix (as for vLLM's and FastAPI's root_path); the document
    names it, and the checks by path (the API key, the error envelope) still apply: uvicorn
    puts the prefix in front of the path the middleware sees."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(web_server.base_url + "/v1/models", headers=auth).status_code == 200
    r = httpx.get(web_server.base_url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(web_server.base_url + "/v1/messages", headers=auth, json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["type"] == "error"  # Anthropic's envelope
    spec = httpx.get(web_server.base_url + "/openapi.json").json()
    assert spec["servers"] == [{"url": "/llm"}]


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


def test_https(tiny_model_dir, tmp_path):
    key_file, cert_file = _self_signed(tmp_path)
    launch = _launch(ssl_keyfile=str(key_file), ssl_certfile=str(cert_file))
    with RunningServer(_factory(tiny_model_dir), ServerOptions(), launch) as server:
        url = server.base_url.replace("http://", "https://")
        verify = ssl.create_default_context(cafile=str(cert_file))
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
            verify=verify,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
            httpx.get(server.base_url + "/health", timeout=5)


def test_max_logprobs(tiny_model_dir):
    from engine.server.serving import ServerLimits, ServingOptions

    options = ServerOptions(serving=ServingOptions(limits=ServerLimits(max_logprobs=30)))
    factory = _factory(tiny_model_dir, max_logprobs=30)
    with RunningServer(factory, options, _launch()) as server:
        url = server.base_url + "/v1/completions"
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logprobs": 30}
        body["return_tokens_as_token_ids"] = True  # distinct keys (texts may coincide)
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 30
        r = httpx.post(url, json={**body, "logprobs": 31}, timeout=60)
        assert r.status_code == 400
        assert "[0, 30]" in r.json()["error"]["message"]


def test_command_line_checks(tmp_path):
    import argparse

    from engine.cli.serve import _check_tls_files, add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--allowed-origins", '["https://a.example", "https://b.example"]'])
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    assert parser.parse_args(["--allowed-origins", "*"]).allowed_origins == ["*"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--allowed-origins", '["ok", 3]'])
    args = parser.parse_args(["--ssl-keyfile", str(tmp_path / "missing.pem")])
    with pytest.raises(ConfigError, match="--ssl-keyfile .*missing.pem: no such file"):
        _check_tls_files(args)
    key = tmp_path / "key.pem"
    key.write_text("x")
    with pytest.raises(ConfigError, match="both --ssl-keyfile and --ssl-certfile"):
        _check_tls_files(parser.parse_args(["--ssl-keyfile", str(key)]))
