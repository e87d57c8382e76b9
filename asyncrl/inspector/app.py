"""The inspector's web app (Starlette, served by uvicorn): pages from `pages`, data from `runs`.

Every request reads what its run wrote since the last one (at most once a second), so a page of
a run still training shows its newest steps; the pages poll `/api/status` and redraw. A run or a
file that cannot be read gives a page that says what is wrong; the server goes on serving.
"""

from __future__ import annotations

import hmac
import threading
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from asyncrl.inspector import pages
from asyncrl.inspector.runs import NotFound, Query, Run, RunError, open_runs

STATIC = Path(__file__).parent / "static"
COOKIE = "asyncrl_inspect"
REFRESH_S = 1.0


class Runs:
    """The runs the app shows, each refreshed at most every REFRESH_S when a request needs it."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs

    def get(self, i: int) -> Run:
        if not 0 <= i < len(self.runs):
            raise NotFound(f"no run {i}: this inspector shows runs 0 to {len(self.runs) - 1}")
        return self.fresh(self.runs[i])

    def fresh(self, run: Run) -> Run:
        if time.monotonic() - run.refreshed > REFRESH_S:
            run.refresh()
            run.refreshed = time.monotonic()
        return run

    def all(self) -> list[Run]:
        return [self.fresh(r) for r in self.runs]

    def keys(self) -> list[str]:
        return sorted({k for r in self.all() for k in r.metrics.series})


def _int(request: Request, name: str) -> int | None:
    return _number(request, name, int)


def _number(request: Request, name: str, kind: type) -> Any:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise RunError(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None


def query_from(request: Request) -> Query:
    """The rollout table's query from the page's URL (a bad value is a RunError naming it)."""
    return Query(step_min=_int(request, "step_min"), step_max=_int(request, "step_max"),
                 source=request.query_params.get("source", ""), reward_min=_number(request, "reward_min", float),
                 reward_max=_number(request, "reward_max", float), length_min=_int(request, "length_min"),
                 length_max=_int(request, "length_max"), text=request.query_params.get("text", "").strip(),
                 sort=request.query_params.get("sort", "-step"), page=_int(request, "page") or 1,
                 per_page=_int(request, "per_page") or Query.per_page)


def html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status)


class Views:
    """The app's pages and JSON answers over `runs` (each a Starlette endpoint)."""

    def __init__(self, runs: list[Run]) -> None:
        self.state = Runs(runs)

    def index(self, request: Request) -> Response:
        return html(pages.overview(self.state.all(), self.state.keys()))

    def _readable(self, request: Request) -> tuple[int, Run]:
        i = int(request.path_params["run"])
        run = self.state.get(i)
        if run.problem:
            raise RunError(run.problem)
        return i, run

    def rollouts(self, request: Request) -> Response:
        i, run = self._readable(request)
        q = query_from(request)
        with run.lock:
            table = run.rollouts.table(q)
            sources = run.rollouts.sources()
        return html(pages.rollout_table(self.state.runs, i, q, table, sources))

    def rollout(self, request: Request) -> Response:
        (i, run), p = self._readable(request), request.path_params
        color = request.query_params.get("color", "diff")
        if color not in ("diff", "advantage"):
            raise RunError(f"color={color!r}: diff or advantage")
        with run.lock:
            row = run.rollouts.row(int(p["step"]), int(p["rank"]), int(p["row"]))
        pieces = run.tokens.pieces(row["response_ids"] or [])
        return html(pages.rollout_detail(self.state.runs, i, row, pieces, color))

    def evals(self, request: Request) -> Response:
        i, run = self._readable(request)
        return html(pages.evaluations(self.state.runs, i, sorted(run.metrics.series), _int(request, "step")))

    def series(self, request: Request) -> Response:
        picked = request.query_params.get("runs")
        chosen = range(len(self.state.runs)) if not picked else [int(x) for x in picked.split(",") if x.isdigit()]
        key, out = request.query_params.get("key", ""), []
        for i in chosen:
            run = self.state.get(i)
            steps, values = run.metrics.points(key)
            out.append({"run": i, "name": run.name, "steps": steps, "values": values})
        return JSONResponse({"key": key, "runs": out})

    def status(self, request: Request) -> Response:
        return JSONResponse({"runs": [r.status() for r in self.state.all()]})

    async def failed(self, request: Request, exc: Exception) -> Response:
        """What went wrong, as a page (or JSON under /api/); the server goes on serving."""
        code = exc.status if isinstance(exc, RunError) else 500
        message = str(exc) if isinstance(exc, RunError) else f"{type(exc).__name__}: {exc} (the server keeps serving)"
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message}, status_code=code)
        return html(pages.problem_page(message, self.state.runs), code)


def build_app(runs: list[Run], token: str | None = None, hosts: list[str] | None = None) -> Starlette:
    """The app over `runs`; with `token`, every request must carry it (once in ?token=, then a cookie);
    with `hosts`, only requests naming one of them in their Host header are answered (a page of
    another site whose name resolves to this machine gets nothing: DNS rebinding)."""
    v = Views(runs)
    routes = [Route("/", v.index), Route("/runs/{run:int}/rollouts", v.rollouts),
              Route("/runs/{run:int}/rollouts/{step:int}/{rank:int}/{row:int}", v.rollout),
              Route("/runs/{run:int}/evals", v.evals), Route("/api/series", v.series), Route("/api/status", v.status),
              Route("/favicon.ico", lambda request: Response(status_code=204)),
              Mount("/static", StaticFiles(directory=STATIC), name="static")]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=hosts)] if hosts else []
    middleware += [Middleware(TokenCheck, token=token)] if token else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers={RunError: v.failed, Exception: v.failed})


class TokenCheck(BaseHTTPMiddleware):
    """A request carries the token as ?token= (answered with a cookie), the cookie, or a bearer header."""

    def __init__(self, app: Any, token: str) -> None:
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next: Any) -> Response:
        given = request.query_params.get("token")
        if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
            response = RedirectResponse(str(request.url.remove_query_params("token")), status_code=303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return response
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
        for candidate in (request.cookies.get(COOKIE, ""), bearer):
            if candidate and hmac.compare_digest(candidate.encode(), self.token.encode()):
                return await call_next(request)
        return HTMLResponse("<p>asyncrl inspect: open the URL with its ?token= as printed where the inspector "
                            "started (or send Authorization: Bearer TOKEN)</p>", status_code=401)


def warm(runs: list[Run]) -> threading.Thread:
    """Read every kept-rollout file's small columns in the background (newest first), so that
    tables sorted by reward or length over a long run answer from memory."""
    def run() -> None:
        for r in runs:
            r.refresh()
            for f in r.rollouts.in_range(None, None, descending=True):
                with r.lock:
                    r.rollouts.scalars(f)

    t = threading.Thread(target=run, name="inspector-warm", daemon=True)
    t.start()
    return t


def serve(paths: list[str], host: str = "127.0.0.1", port: int = 8765, token: str | None = None) -> int:
    """Serve `paths` until interrupted; a host other than this machine's loopback gets a token."""
    import secrets
    import socket

    import uvicorn

    runs = open_runs(paths)
    for r in runs:
        r.refresh()
        if r.problem:
            print(f"asyncrl inspect: {r.problem} (its page says so; the others are served)", flush=True)
    loopback = host in ("127.0.0.1", "localhost")
    if token is None and not loopback:
        token = secrets.token_urlsafe(24)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections wait in the backlog until the server runs: the printed URL answers at once
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/" + (f"?token={token}" if token else "")
    print(f"asyncrl inspect: {len(runs)} run(s) at {url} (Ctrl-C stops it)", flush=True)
    warm(runs)
    app = build_app(runs, token, ["127.0.0.1", "localhost"] if loopback else None)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])
    return 0
