"""The dashboard's Starlette application (runs on trio and asyncio: Starlette is anyio)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from urllib.parse import parse_qs

import anyio
from redis import exceptions as rexc

try:
    import starlette  # noqa: F401
except ImportError as _e:  # pragma: no cover - the extra is missing
    raise ImportError("the dashboard needs the dashboard extra: pip install '.[dashboard]' in a "
                      "checkout of trio_redis_finalize (its [dashboard] extra)") from _e
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from .._cli._common import key_type
from .._transport import Client, ClusterClient, SentinelClient, parse_url
from . import _render as render
from ._actions import ActionError, apply, plan, seen_of
from ._data import dead_letter, overview, subscription
from ._discover import Found, Sub, discover

__all__ = ["Settings", "build"]

log = logging.getLogger("trio_redis_finalize.dashboard")

CSRF_COOKIE = "trf_csrf"
TOKEN_COOKIE = "trf_token"


class Settings:
    """What :func:`build` was given (see ``trio_redis_finalize.dashboard.app``)."""

    def __init__(self, target: str | Client, *, token: str | None = None,
                 basic_auth: tuple[str, str] | None = None, read_only: bool = False,
                 keys: tuple[str, ...] = (), refresh: float = 5.0, rediscover: float = 30.0) -> None:
        if isinstance(target, str):
            parse_url(target)  # a bad URL fails now, naming itself
        if token is not None and not token:
            raise ValueError("token: must not be empty")
        if basic_auth is not None and (len(basic_auth) != 2 or not basic_auth[0] or not basic_auth[1]):
            raise ValueError("basic_auth: must be (user, password), both non-empty")
        if refresh <= 0:
            raise ValueError(f"refresh: must be > 0 seconds, got {refresh!r}")
        self.target = target
        self.token = token
        self.basic_auth = basic_auth
        self.keys = tuple(keys)
        self.refresh = refresh
        self.rediscover = rediscover
        self.read_only = read_only or (token is None and basic_auth is None)
        self.auth = token is not None or basic_auth is not None


class _State:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client: Client | None = settings.target if not isinstance(settings.target, str) else None
        self.owned = False
        self.found: Found | None = None
        self.found_at = -1e9
        self.lock = anyio.Lock()

    def get_client(self) -> Client:
        if self.client is None:  # mounted in another app (no lifespan): made on first use
            params = parse_url(str(self.settings.target))
            cls = ClusterClient if params.cluster_seeds else SentinelClient if params.sentinels else Client
            self.client = cls(params, name="trf-dashboard", max_connections=8)
            self.owned = True
        return self.client

    async def subs(self, force: bool = False) -> Found:
        async with self.lock:
            now = time.monotonic()
            if force or self.found is None or now - self.found_at > self.settings.rediscover:
                self.found = await discover(self.get_client(), self.settings.keys)
                self.found_at = now
            return self.found


def _static(name: str) -> bytes:
    return resources.files("trio_redis_finalize._dashboard").joinpath("static", name).read_bytes()


def build(settings: Settings, root_path: str = "") -> Starlette:
    """The ASGI app."""
    state = _State(settings)
    static = {n: _static(n) for n in ("dashboard.css", "dashboard.js")}
    root = root_path.rstrip("/")

    def who(request: Request) -> str | None:
        """The user the request authenticates as (None: not authenticated)."""
        if settings.token is not None:
            header = request.headers.get("authorization", "")
            given = (header[7:] if header.lower().startswith("bearer ")
                     else request.cookies.get(TOKEN_COOKIE, ""))
            if given and hmac.compare_digest(given.encode(), settings.token.encode()):
                return "token"
        if settings.basic_auth is not None:
            header = request.headers.get("authorization", "")
            if header.lower().startswith("basic "):
                try:
                    user, _, pw = base64.b64decode(header[6:]).decode().partition(":")
                except (binascii.Error, UnicodeDecodeError):
                    return None
                u, p = settings.basic_auth
                same_user = hmac.compare_digest(user.encode(), u.encode())
                if hmac.compare_digest(pw.encode(), p.encode()) and same_user:
                    return user
        return None

    def csrf_of(request: Request) -> str:
        return request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)

    def page(request: Request, title: str, body: str, *, refresh: bool = False, status: int = 200,
             note: str = "") -> Response:
        user = who(request)
        if request.headers.get("x-partial"):
            resp: Response = HTMLResponse(body, status_code=status)
        else:
            resp = HTMLResponse(render.layout(title, body, root=root, read_only=settings.read_only, who=user,
                                              note=note or request.query_params.get("msg", ""),
                                              refresh=settings.refresh if refresh else None),
                                status_code=status)
        if CSRF_COOKIE not in request.cookies:
            resp.set_cookie(CSRF_COOKIE, request.state.csrf, httponly=True, samesite="strict",
                            path=root or "/")
        resp.headers["content-security-policy"] = (
            "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'")
        resp.headers["x-content-type-options"] = "nosniff"
        resp.headers["cache-control"] = "no-store"
        return resp

    Handler = Callable[[Request], Awaitable[Response]]

    def guarded(handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            request.state.csrf = csrf_of(request)
            if settings.auth and who(request) is None:
                if request.headers.get("x-partial"):  # the page's refresh: no login page inside it
                    return Response("authentication required\n", status_code=401)
                if settings.token is not None and settings.basic_auth is None:
                    return RedirectResponse(f"{root}/login", status_code=303)
                return Response("authentication required\n", status_code=401,
                                headers={"www-authenticate": 'Basic realm="trio_redis_finalize"'})
            try:
                return await handler(request)
            except (rexc.RedisError, OSError) as err:
                log.warning("dashboard: %s %s: Redis error: %s", request.method, request.url.path, err)
                return page(request, "Redis error", render.message_page(
                    "Redis error", f"{type(err).__name__}: {err}", f"{root}/", "bad"), status=502)
        return wrapped

    async def overview_page(request: Request) -> Response:
        client = state.get_client()
        t0 = time.perf_counter()
        found = await state.subs()
        ov = await overview(client, found)
        body = render.overview_body(ov, root, (time.perf_counter() - t0) * 1000)
        return page(request, "Overview", body, refresh=True)

    async def sub_page(request: Request) -> Response:
        key = request.path_params["key"]
        group = request.query_params.get("group", "")
        client = state.get_client()
        found = await state.subs()
        sub = next((s for s in found.subs if s.key == key and s.group == group), None)
        if sub is None:
            if group and await key_type(client, key) == "stream":
                sub = Sub("stream", key, group)
            else:
                return page(request, key, render.message_page(
                    key, f"{key!r}{' group ' + repr(group) if group else ''} is not a subscription "
                         "the dashboard knows (a stream's group or a reliable list).",
                    f"{root}/", "bad"), status=404)
        try:
            info = await subscription(client, sub, request.query_params.get("after"))
        except rexc.ResponseError as err:
            return page(request, key, render.message_page(key, f"not a subscription: {err}", f"{root}/",
                                                          "bad"), status=404)
        except Exception as err:
            if type(err).__name__ == "CliError":
                return page(request, key, render.message_page(key, f"not a subscription: {err}", f"{root}/",
                                                              "bad"), status=404)
            raise
        return page(request, sub.name, render.sub_page(sub, info, root, str(request.url)), refresh=True)

    async def dead_view(request: Request) -> Response:
        key = request.path_params["key"]
        reason = request.query_params.get("reason") or None
        info = await dead_letter(state.get_client(), key, request.query_params.get("after"), reason)
        status = 200 if info["kind"] in ("stream", "list") else 404
        body = render.dead_page(info, root, request.state.csrf, settings.read_only, reason)
        return page(request, f"Dead letter {key}", body, status=status)

    def refused(request: Request, form: dict[str, list[str]]) -> str | None:
        """Why a POST is refused (cross-site, missing or wrong CSRF token), or None."""
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return f"cross-site request refused (Sec-Fetch-Site: {site})"
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            host = request.headers.get("host", "")
            if origin.split("://", 1)[-1] != host:
                return f"cross-origin request refused (Origin {origin} is not {host})"
        cookie = request.cookies.get(CSRF_COOKIE, "")
        given = (form.get("csrf") or [""])[0]
        if not cookie or not given or not hmac.compare_digest(cookie.encode(), given.encode()):
            return "missing or wrong CSRF token (reload the page and try again)"
        return None

    async def action(request: Request) -> Response:
        key = request.path_params["key"]
        name = request.path_params["action"]
        back = render.dead_url(root, key)
        form = parse_qs((await request.body()).decode("utf-8", "replace"), keep_blank_values=True)
        why = refused(request, form)
        if why is not None:
            log.warning("dashboard: %s %s refused: %s", name, key, why)
            return page(request, "Refused", render.message_page("Refused", why, back, "bad"), status=403)
        if settings.read_only:
            return page(request, "Read-only", render.message_page(
                "Read-only", "this dashboard is read-only: actions need --token or --basic-auth "
                             "(and no --read-only)", back, "bad"), status=403)
        user = who(request) or "-"

        def one(name: str) -> str | None:
            values = form.get(name)
            return values[0] if values else None

        force = one("force") == "yes"
        client = state.get_client()
        try:
            p = await plan(client, key, name, one("scope") or "", form.get("id", []), one("reason"), force)
            if one("confirm") != "yes":
                log.info("dashboard: %s asked to %s (dry run)", user, p.describe())
                return page(request, "Confirm", render.confirm_page(p, root, request.state.csrf, force))
            n = await apply(client, p, force, seen_of(p, one("count"), one("upto")))
        except ActionError as err:
            log.warning("dashboard: %s: %s %s refused: %s", user, name, key, err)
            return page(request, "Refused", render.message_page("Refused", str(err), back, "bad"), status=409)
        except Exception as err:
            if type(err).__name__ == "CliError":  # the safe requeue's refusals
                log.warning("dashboard: %s: %s %s refused: %s", user, name, key, err)
                return page(request, "Refused", render.message_page("Refused", str(err), back, "bad"),
                            status=409)
            raise
        done = f"{'requeued' if name == 'requeue' else 'deleted'} {n} message{'s' if n != 1 else ''}"
        log.warning("dashboard: %s %s from %s (scope %s%s)", user, done, key, p.scope,
                    f", reason {p.reason!r}" if p.reason else f", ids {p.ids}" if p.ids else "")
        await state.subs(force=True)
        return RedirectResponse(render.dead_url(root, key, msg=done), status_code=303)

    async def login(request: Request) -> Response:
        request.state.csrf = csrf_of(request)
        if request.method == "POST":
            form = parse_qs((await request.body()).decode("utf-8", "replace"))
            why = refused(request, form)
            token = (form.get("token") or [""])[0]
            good = bool(settings.token) and hmac.compare_digest(token.encode(), str(settings.token).encode())
            if why is None and good:
                resp = RedirectResponse(f"{root}/", status_code=303)
                resp.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict", path=root or "/")
                log.info("dashboard: token login")
                return resp
            log.warning("dashboard: failed login (%s)", why or "wrong token")
            return page(request, "Login", _login_form(request, why or "wrong token"), status=403)
        return page(request, "Login", _login_form(request, ""))

    def _login_form(request: Request, error: str) -> str:
        err = f"<p class='bad'>{render.e(error)}</p>" if error else ""
        return (f"<h1>Log in</h1>{err}<form method='post' action='{root}/login'>"
                f"<input type='hidden' name='csrf' value='{render.e(request.state.csrf)}'>"
                "<input type='password' name='token' id='token' placeholder='token' autofocus> "
                "<button type='submit' id='login'>log in</button></form>")

    async def static_file(request: Request) -> Response:
        name = request.path_params["name"]
        body = static.get(name)
        if body is None:
            return Response("not found\n", status_code=404)
        kind = "text/css" if name.endswith(".css") else "text/javascript"
        return Response(body, media_type=kind, headers={"cache-control": "max-age=300"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if state.owned and state.client is not None:
                with anyio.CancelScope(shield=True):
                    await state.client.aclose()
                state.client = None

    routes = [
        Route("/", guarded(overview_page)),
        Route("/sub/{key:path}", guarded(sub_page)),
        Route("/dead/{key:path}/{action:str}", guarded(action), methods=["POST"]),
        Route("/dead/{key:path}", guarded(dead_view)),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/static/{name:str}", static_file),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dashboard = state
    return app
