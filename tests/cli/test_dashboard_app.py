"""The dashboard over HTTP: the ASGI app called as a server calls it, and served by Hypercorn.

Auth (token, basic), read-only refusal, cross-site and CSRF refusals, the
dry run and confirmation of each action, the safe requeue's refusal, a
page of a key that is not a subscription, the command line; on trio and
on asyncio.
"""

from __future__ import annotations

import base64
import logging
import re
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable
from html import unescape
from typing import Any
from urllib.parse import quote, unquote, urlencode

import anyio
import pytest
from _dashboard_scenario import BAD, DEAD, GROUP, STREAM, make_trouble

from trio_redis_finalize import dashboard
from trio_redis_finalize._transport import Client, open_client

BACKENDS = ["trio", "asyncio"]
DEAD_PATH = "/dead/" + quote(DEAD, safe="")


class Browser:
    """Calls an ASGI app as an HTTP server would, keeping cookies."""

    def __init__(self, app: Any, headers: dict[str, str] | None = None) -> None:
        self.app = app
        self.headers = dict(headers or {})
        self.cookies: dict[str, str] = {}

    async def request(self, method: str, path: str, form: dict[str, Any] | None = None,
                      headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
        path, _, query = path.partition("?")
        body = urlencode(form or {}, doseq=True).encode()
        hdrs = {"host": "127.0.0.1:8000", **self.headers, **(headers or {})}
        if self.cookies:
            hdrs["cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if form is not None:
            hdrs["content-type"] = "application/x-www-form-urlencoded"
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": unquote(path), "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
        }
        sent: list[dict[str, Any]] = []
        done = False

        async def receive() -> dict[str, Any]:
            nonlocal done
            if done:
                await anyio.sleep_forever()
            done = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        with anyio.fail_after(20):
            await self.app(scope, receive, send)
        start = sent[0]
        headers_out: dict[str, str] = {}
        for k, v in start["headers"]:
            name, value = k.decode(), v.decode()
            if name == "set-cookie":
                cname, _, rest = value.partition("=")
                self.cookies[cname] = rest.split(";")[0]
            headers_out[name] = value
        text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
        return start["status"], headers_out, text

    async def get(self, path: str, **kw: Any) -> tuple[int, dict[str, str], str]:
        return await self.request("GET", path, **kw)

    def csrf(self) -> str:
        return self.cookies["trf_csrf"]

    async def post(self, path: str, form: dict[str, Any], **kw: Any) -> tuple[int, dict[str, str], str]:
        return await self.request("POST", path, {"csrf": self.csrf(), **form}, **kw)


def run(backend: str, main: Callable[[], Awaitable[None]]) -> None:
    anyio.run(main, backend=backend)


def run_with_client(backend: str, redis_url: str, main: Callable[[Client], Awaitable[None]],
                    trouble: bool = False) -> None:
    """``main(client)`` on ``backend``, with a client of the server (on which
    ``make_trouble`` ran first, if ``trouble``)."""

    async def with_client() -> None:
        async with open_client(redis_url) as client:
            if trouble:
                await make_trouble(redis_url, client)
            await main(client)

    run(backend, with_client)


async def opened(url: str) -> Any:
    return open_client(url)


async def dead_ids(client: Client) -> list[str]:
    return [e[0].decode() for e in await client.execute("XRANGE", DEAD, "-", "+")]


async def close(app: Any) -> None:
    state = app.state.dashboard
    if state.owned and state.client is not None:
        await state.client.aclose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_by_default_refuses_actions(redis_url: str, backend: str) -> None:
    async def main(client: Client) -> None:
        app = dashboard.app(redis_url)  # no credentials: read-only
        b = Browser(app)
        status, headers, html = await b.get("/")
        assert status == 200 and "read-only" in html and "worker-dead" in html
        assert "default-src 'self'" in headers["content-security-policy"]
        status, _, html = await b.get(DEAD_PATH)
        assert status == 200 and "disabled" in html
        (first, _) = await dead_ids(client)
        status, _, html = await b.post(DEAD_PATH + "/requeue",
                                       {"scope": "ids", "id": first, "confirm": "yes"})
        assert status == 403 and "read-only" in html
        assert len(await dead_ids(client)) == BAD
        # credentials do not lift --read-only
        app2 = dashboard.app(redis_url, token="s3cret", read_only=True)
        b2 = Browser(app2, {"authorization": "Bearer s3cret"})
        await b2.get("/")
        status, _, _ = await b2.post(DEAD_PATH + "/requeue", {"scope": "ids", "id": first,
                                                              "confirm": "yes"})
        assert status == 403 and len(await dead_ids(client)) == BAD
        await close(app)
        await close(app2)

    run_with_client(backend, redis_url, main, trouble=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_and_basic_auth(redis_url: str, backend: str) -> None:
    async def main(client: Client) -> None:
        app = dashboard.app(client, token="s3cret")
        b = Browser(app)
        status, headers, _ = await b.get("/")
        assert status == 303 and headers["location"] == "/login"
        status, _, _ = await b.get("/", headers={"x-partial": "1"})  # a refresh, logged out
        assert status == 401
        status, _, html = await b.get("/login")
        assert status == 200 and "token" in html
        status, _, _ = await b.post("/login", {"token": "wrong"})
        assert status == 403 and "trf_token" not in b.cookies
        status, headers, _ = await b.post("/login", {"token": "s3cret"})
        assert status == 303 and b.cookies["trf_token"] == "s3cret"
        status, _, html = await b.get("/")
        assert status == 200 and "actions on (token)" in html
        status, _, _ = await Browser(app, {"authorization": "Bearer s3cret"}).get("/")
        assert status == 200

        basic = dashboard.app(client, basic_auth=("ops", "pw"))
        status, headers, _ = await Browser(basic).get("/")
        assert status == 401 and headers["www-authenticate"].startswith("Basic")
        bad = base64.b64encode(b"ops:nope").decode()
        status, _, _ = await Browser(basic, {"authorization": f"Basic {bad}"}).get("/")
        assert status == 401
        good = base64.b64encode(b"ops:pw").decode()
        status, _, html = await Browser(basic, {"authorization": f"Basic {good}"}).get("/")
        assert status == 200 and "actions on (ops)" in html

    run_with_client(backend, redis_url, main)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_site_and_csrf_refused(redis_url: str, backend: str) -> None:
    async def main(client: Client) -> None:
        b = Browser(dashboard.app(client, token="t"), {"authorization": "Bearer t"})
        await b.get(DEAD_PATH)
        form = {"scope": "all", "confirm": "yes"}
        for extra, headers in [
            ({"csrf": "forged"}, {}),
            ({}, {"sec-fetch-site": "cross-site"}),
            ({}, {"origin": "http://evil.example"}),
        ]:
            status, _, html = await b.post(DEAD_PATH + "/delete", {**form, **extra}, headers=headers)
            assert (status == 403 and "refused" in html.lower()) or "CSRF" in html, (extra, headers)
        status, _, _ = await b.request("POST", DEAD_PATH + "/delete", form)  # no token at all
        assert status == 403
        assert len(await dead_ids(client)) == BAD
        # same origin passes
        status, _, _ = await b.post(DEAD_PATH + "/delete", form,
                                    headers={"origin": "http://127.0.0.1:8000",
                                             "sec-fetch-site": "same-origin"})
        assert status == 303 and await dead_ids(client) == []

    run_with_client(backend, redis_url, main, trouble=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_requeue_one_asks_first_then_moves_it_back(redis_url: str, backend: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    async def main(client: Client) -> None:
        b = Browser(dashboard.app(client, basic_auth=("ops", "pw")),
                    {"authorization": "Basic " + base64.b64encode(b"ops:pw").decode()})
        await b.get(DEAD_PATH)
        first, second = await dead_ids(client)
        length = int(await client.execute("XLEN", STREAM))
        status, _, html = await b.post(DEAD_PATH + "/requeue", {"scope": "ids", "id": first})
        assert status == 200
        assert f"This will requeue 1 message from {DEAD} (1 to {STREAM})" in html
        assert await dead_ids(client) == [first, second]  # a dry run moved nothing
        status, headers, _ = await b.post(DEAD_PATH + "/requeue",
                                          {"scope": "ids", "id": first, "confirm": "yes"})
        assert status == 303 and "requeued+1+message" in headers["location"]
        assert await dead_ids(client) == [second]
        assert int(await client.execute("XLEN", STREAM)) == length + 1
        _, flat = (await client.execute("XREVRANGE", STREAM, "+", "-", "COUNT", 1))[0]
        names = flat[::2]
        assert b"bad" in names and not any(n.startswith(b"trf-dead-") for n in names)
        # the same requeue again: gone already, nothing moved twice
        status, _, html = await b.post(DEAD_PATH + "/requeue",
                                       {"scope": "ids", "id": first, "confirm": "yes"})
        assert status == 303 and int(await client.execute("XLEN", STREAM)) == length + 1
        # delete all: the dry run counts, the confirmation deletes
        status, _, html = await b.post(DEAD_PATH + "/delete", {"scope": "all"})
        assert f"This will delete 1 message from {DEAD}" in html
        status, _, _ = await b.post(DEAD_PATH + "/delete", {"scope": "all", "confirm": "yes"})
        assert status == 303 and int(await client.execute("XLEN", DEAD)) == 0  # (XTRIM: key kept)

    caplog.set_level(logging.INFO, "trio_redis_finalize.dashboard")
    run_with_client(backend, redis_url, main, trouble=True)
    logged = [r.getMessage() for r in caplog.records if r.name == "trio_redis_finalize.dashboard"]
    assert any(re.search(r"ops requeued 1 message from \{orders\}:dead \(scope ids", m) for m in logged)
    assert any("ops deleted 1 message" in m for m in logged)


def confirmation(html: str) -> dict[str, list[str]]:
    """The confirmation form's hidden fields, as a browser posts them."""
    out: dict[str, list[str]] = {}
    for name, value in re.findall(r"<input type='hidden' name='([^']*)' value='([^']*)'>", html):
        out.setdefault(unescape(name), []).append(unescape(value))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_confirmation_acts_only_on_what_its_dry_run_counted(redis_url: str, backend: str) -> None:
    """A consumer dead-letters while the operator reads the confirmation: the
    confirmed requeue (by reason) and delete (all) act on the entries the dry
    run counted, and the one written since stays.  Before, the confirmation
    planned again and the delete took the newer entry too, unseen."""
    async def main(client: Client) -> None:
        b = Browser(dashboard.app(client, token="t"), {"authorization": "Bearer t"})
        await b.get(DEAD_PATH)
        ids = await dead_ids(client)
        ((_, flat),) = await client.execute("XRANGE", DEAD, ids[0], ids[0])
        reason = dict(zip(flat[::2], flat[1::2], strict=True))[b"trf-dead-reason"].decode()

        async def dead_lettered_meanwhile() -> str:  # a copy of a dead letter, its reason alike
            return (await client.execute("XADD", DEAD, "*", *flat)).decode()

        status, _, html = await b.post(DEAD_PATH + "/requeue", {"scope": "reason", "reason": reason})
        assert status == 200 and f"requeue {BAD} messages" in html
        late = await dead_lettered_meanwhile()
        status, _, _ = await b.post(DEAD_PATH + "/requeue", confirmation(html))
        assert status == 303 and await dead_ids(client) == [late]
        status, _, html = await b.post(DEAD_PATH + "/delete", {"scope": "all"})
        assert f"This will delete 1 message from {DEAD}" in html
        later = await dead_lettered_meanwhile()
        status, headers, _ = await b.post(DEAD_PATH + "/delete", confirmation(html))
        assert status == 303 and "deleted+1+message" in headers["location"]
        assert await dead_ids(client) == [later]

    run_with_client(backend, redis_url, main, trouble=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_requeue_by_reason_and_the_safe_requeues_refusal(redis_url: str, backend: str) -> None:
    async def main(client: Client) -> None:
        b = Browser(dashboard.app(client, token="t"), {"authorization": "Bearer t"})
        status, _, html = await b.get(DEAD_PATH)
        reason = re.search(r"<td class='reason'>([^<]+)</td>", html)
        assert reason is not None
        why = reason.group(1).replace("&#x27;", "'").replace("&amp;", "&").replace("&quot;", '"')
        # the selected ones (the checkboxes' form): both, in the dry run
        status, _, html = await b.post(DEAD_PATH + "/requeue", {"scope": "ids",
                                                                "id": await dead_ids(client)})
        assert f"This will requeue {BAD} messages from {DEAD} ({BAD} to {STREAM})" in html
        status, _, html = await b.post(DEAD_PATH + "/requeue", {"scope": "reason", "reason": why})
        assert f"requeue {BAD} messages" in html
        # a consumer group reading the dead letter with entries pending: refused unless forced
        await client.execute("XGROUP", "CREATE", DEAD, "reader", "0")
        await client.execute("XREADGROUP", "GROUP", "reader", "r1", "COUNT", 1, "STREAMS", DEAD, ">")
        status, _, html = await b.post(DEAD_PATH + "/requeue", {"scope": "reason", "reason": why})
        assert status == 200 and "id='refusal'" in html and "pending" in html
        status, _, html = await b.post(DEAD_PATH + "/requeue",
                                       {"scope": "reason", "reason": why, "confirm": "yes"})
        assert status == 409 and len(await dead_ids(client)) == BAD
        status, _, _ = await b.post(DEAD_PATH + "/delete", {"scope": "all", "confirm": "yes"})
        assert status == 409 and len(await dead_ids(client)) == BAD  # delete: refused alike
        status, _, _ = await b.post(DEAD_PATH + "/requeue", {"scope": "reason", "reason": why,
                                                             "confirm": "yes", "force": "yes"})
        assert status == 303 and await dead_ids(client) == []

    run_with_client(backend, redis_url, main, trouble=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_that_is_not_a_subscription_says_so(redis_url: str, backend: str) -> None:
    async def main(client: Client) -> None:
        await client.execute("SET", "plain", "x")
        b = Browser(dashboard.app(client))
        status, _, html = await b.get("/dead/plain")
        assert status == 404 and "plain is a string: not a dead letter." in html
        status, _, html = await b.get("/sub/plain")
        assert status == 404 and "is not a subscription the dashboard knows" in html
        status, _, html = await b.get("/sub/nothing?group=g")
        assert status == 404 and "'nothing' group 'g' is not a subscription" in unescape(html)
        status, _, js = await b.get("/static/dashboard.js")
        assert status == 200 and "X-Partial" in js
        status, _, part = await b.get("/", headers={"x-partial": "1"})
        assert status == 200 and "<html" not in part and "Overview" in part

    run_with_client(backend, redis_url, main)


@pytest.mark.parametrize("backend", BACKENDS)
def test_served_by_hypercorn_in_a_task_group(redis_url: str, backend: str) -> None:
    """``serve`` in the caller's task group (as beside a consumer), on trio and asyncio."""

    async def main() -> None:
        async with open_client(redis_url) as client, anyio.create_task_group() as tg:
            await make_trouble(redis_url, client)
            with anyio.fail_after(20):
                port = await tg.start(dashboard.serve, redis_url, 0)

                def fetch() -> str:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
                        body: str = r.read().decode()
                        return body

                html = await anyio.to_thread.run_sync(fetch)
                assert "worker-dead" in html and "Overview" in html
            tg.cancel_scope.cancel()

    run(backend, main)


def test_the_command_line(redis_url: str) -> None:
    async def setup() -> None:
        async with open_client(redis_url) as client:
            await make_trouble(redis_url, client)

    anyio.run(setup)
    proc = subprocess.Popen([sys.executable, "-m", "trio_redis_finalize", "dashboard", "--url", redis_url,
                             "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"dashboard on http://127\.0\.0\.1:(\d+)/ \(this host only; read-only\)", line)
        assert m, line
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/sub/{STREAM}?group={GROUP}",
                                    timeout=10) as r:
            html = r.read().decode()
        assert "worker-dead" in html and "lapsed" in html
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([sys.executable, "-m", "trio_redis_finalize", "dashboard", "--url", "nope://x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "error" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.parametrize("topology", ["sentinel", "cluster"])
def test_the_app_from_a_sentinel_or_cluster_url(request: pytest.FixtureRequest, topology: str) -> None:
    """Given only the URL (mounted elsewhere: no lifespan), it makes its own client of the kind."""
    url = (request.getfixturevalue("redis_sentinel").url if topology == "sentinel"
           else request.getfixturevalue("redis_cluster_url"))

    async def main() -> None:
        with anyio.fail_after(60):
            async with open_client(url) as client:
                await make_trouble(url, client)
            app = dashboard.app(url, token="t")
            b = Browser(app, {"authorization": "Bearer t"})
            status, _, html = await b.get("/")
            assert status == 200 and "stranded 3: worker-dead" in html
            status, _, html = await b.post(DEAD_PATH + "/requeue", {"scope": "all"})
            assert f"This will requeue {BAD} messages from {DEAD} ({BAD} to {STREAM})" in html
            status, _, _ = await b.post(DEAD_PATH + "/requeue", {"scope": "all", "confirm": "yes"})
            assert status == 303
            async with open_client(url) as client:
                assert int(await client.execute("XLEN", DEAD)) == 0
                entries = await client.execute("XRANGE", STREAM, "-", "+")
                assert sum(f[f.index(b"bad") + 1] == b"yes" for _, f in entries if b"bad" in f) == 2 * BAD
            await close(app)

    anyio.run(main)
