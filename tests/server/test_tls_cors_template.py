"""One server of its own (the embedded model, a small KV pool) with the settings the shared one
leaves at their defaults: HTTPS with a certificate made here, CORS limited to one origin, a chat
template of our own, and prefix caching (``usage.prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import ssl
import time

import jinja2
import openai
import pytest
from helpers_server import API_KEY, MODEL, Server

pytestmark = pytest.mark.timeout(600)

ORIGIN = "https://app.example.com"
# Uses a chat_template_kwargs variable (`persona`), and no special tokens.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}{% if persona %} as {{ persona }}{% endif %}] "
            "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def self_signed(tmp_path) -> tuple[str, str]:
    """(key file, certificate file) for 127.0.0.1, made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    key_file, cert_file = self_signed(tmp)
    template_file = tmp / "template.jinja"
    template_file.write_text(TEMPLATE)
    s = Server.start(tmp, "engine.num_kv_blocks=64", "scheduler.enable_prefix_caching=true",
                     f"server.ssl_keyfile={key_file}", f"server.ssl_certfile={cert_file}",
                     f"server.allowed_origins=['{ORIGIN}']", "server.allowed_methods=[GET,POST]",
                     f"server.chat_template={template_file}")
    s.ssl_context = ssl.create_default_context(cafile=cert_file)
    try:
        yield s
    finally:
        s.kill()


def test_https_with_the_openai_client(tls_server):
    assert tls_server.url.startswith("https://127.0.0.1:")
    http_client = openai.DefaultHttpxClient(verify=tls_server.ssl_context)
    with openai.OpenAI(base_url=tls_server.url + "/v1", api_key=API_KEY, max_retries=0, http_client=http_client) as c:
        r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2 and r.choices[0].text
    untrusting = http.client.HTTPSConnection(tls_server.host, tls_server.port, timeout=30,
                                             context=ssl.create_default_context())
    with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust the certificate
        untrusting.request("GET", "/health")
    untrusting.close()


def test_cors_lets_in_only_the_configured_origin(tls_server):
    def preflight(origin: str) -> tuple[int, dict]:
        status, headers, _ = tls_server.request("OPTIONS", "/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        return status, {k.lower(): v for k, v in headers.items()}

    status, headers = preflight(ORIGIN)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert set(headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    status, headers = preflight("https://evil.example.com")
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers, _ = tls_server.request("GET", "/v1/models", headers=tls_server.headers({"Origin": ORIGIN}))
    assert status == 200 and {k.lower(): v for k, v in headers.items()}["access-control-allow-origin"] == ORIGIN


def test_the_configured_chat_template_and_its_kwargs(tls_server):
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs in ({}, {"persona": "pirate"}):
        status, r = tls_server.post("/tokenize", {"messages": messages, "chat_template_kwargs": kwargs})
        assert status == 200, r
        status, text = tls_server.post("/detokenize", {"tokens": r["tokens"]})
        expected = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                    persona=kwargs.get("persona"))
        assert text["prompt"] == expected
        status, answer = tls_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                                  "chat_template_kwargs": kwargs})
        assert status == 200 and answer["usage"]["prompt_tokens"] == r["count"]


def test_cached_tokens_with_prefix_caching(tls_server):
    prompt = "Count the planets of the solar system, from the sun outwards, one by one: " * 3
    bodies = [{"prompt": prompt + suffix, "max_tokens": 1, "temperature": 0} for suffix in ("Mercury", "Venus")]
    _, first = tls_server.post("/v1/completions", bodies[0])
    assert first["usage"]["prompt_tokens_details"] is None  # nothing cached yet
    status, second = tls_server.post("/v1/completions", bodies[1])
    assert status == 200
    common = 0
    ids = [tls_server.post("/tokenize", {"prompt": b["prompt"]})[1]["tokens"] for b in bodies]
    while ids[0][common] == ids[1][common]:
        common += 1
    block_size = 16  # engine.block_size's default: whole blocks are cached
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": common // block_size * block_size}
    deadline = time.monotonic() + 30
    while True:  # the engine's counters arrive with its next stats message
        _, _, data = tls_server.request("GET", "/metrics")
        hits = [line for line in data.decode().splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
        if (hits and float(hits[0].rsplit(" ", 1)[1]) > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert float(hits[0].rsplit(" ", 1)[1]) == common // block_size * block_size
    assert json.loads(tls_server.request("GET", "/health")[2]) == {"status": "ok"}
