"""The status page, `GET /ui`: static files shipped in the package (`router/ops/ui/static/`), no
build step. The page draws itself from the admin JSON (`/admin/pools`, `/admin/accounting`,
`/admin/history`, and `/admin/decisions` where the rebalancer answers it) and refreshes itself.

Access is that of /admin/*: the admin key or an admin tenant's key, open only on a router with
no key of any kind on a loopback host. A browser cannot send a bearer token on navigation, so
a refused `/ui` asks for HTTP Basic credentials (`WWW-Authenticate: Basic`): any user name, the
key as the password; the browser then sends them with the page's own calls to /admin/*, which
take Basic credentials too (router/identity.py).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.errors import GpupoolError, NotFound, Unauthorized
from router.identity import OperatorAccess

__all__ = ["ASSETS", "register_ui"]

# file name -> media type; nothing else under static/ is served
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "plot.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}
_REALM = 'Basic realm="gpupool admin (any user name, the admin key as password)"'


def _load_assets() -> dict[str, bytes]:
    root = resources.files(__package__).joinpath("static")
    return {name: root.joinpath(name).read_bytes() for name in ASSETS}


def register_ui(api: FastAPI, access: OperatorAccess) -> None:
    """Add `GET /ui` and `GET /ui/{asset}` to `api`, guarded as /admin/* is."""
    assets = _load_assets()

    def answer(request: Request, name: str) -> Response:
        try:
            access.authorize_admin(request.headers.get("authorization"))
        except Unauthorized as err:
            return _ask_for_credentials(err)
        return Response(assets[name], media_type=ASSETS[name], headers=_HEADERS)

    @api.get("/ui", include_in_schema=False)
    async def ui_page(request: Request) -> Response:
        return answer(request, "index.html")

    @api.get("/ui/{asset}", include_in_schema=False)
    async def ui_asset(asset: str, request: Request) -> Response:
        if asset not in assets or asset == "index.html":
            raise NotFound(f"/ui/{asset[:100]} is not part of the status page", "unknown_endpoint")
        return answer(request, asset)


def _ask_for_credentials(err: GpupoolError) -> Response:
    headers = {k.decode(): v.decode() for k, v in err.headers()}
    headers["WWW-Authenticate"] = _REALM
    return Response(
        err.body(), status_code=err.status, media_type="application/json", headers=headers
    )
