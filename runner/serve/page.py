"""The chat page (runner/serve/webui/): its files, read once from the package, served at / and
/webui/NAME without the API key, with a Content-Security-Policy that lets the page run only its own
scripts and styles, and an ETag, so a browser keeps them and asks only whether they changed."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Route

PREFIX = "/webui/"
INDEX = "index.html"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}  # (no-cache: kept, and revalidated by its ETag on each load)


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


@cache
def assets() -> dict[str, Asset]:
    """The page's files by name (those of a type it serves)."""
    found = {}
    for item in files(__package__).joinpath("webui").iterdir():
        suffix = item.name[item.name.rfind("."):]
        if item.is_file() and suffix in MEDIA_TYPES:
            body = item.read_bytes()
            found[item.name] = Asset(body, MEDIA_TYPES[suffix], f'"{hashlib.sha256(body).hexdigest()[:16]}"')
    return found


def is_page(path: str) -> bool:
    return path == "/" or path.startswith(PREFIX)


def wants_page(request) -> bool:
    """A browser's request for / (it accepts HTML); other clients get the plain answer."""
    return "text/html" in request.headers.get("accept", "")


def answer(request, name: str) -> Response:
    asset = assets().get(name)
    if asset is None:
        raise HTTPException(404)
    headers = {**HEADERS, "ETag": asset.etag}
    if asset.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(asset.body, headers=headers, media_type=asset.media_type)


async def webui_file(request):
    return answer(request, request.path_params["name"])


ROUTES = [Route(PREFIX + "{name}", webui_file, methods=["GET", "HEAD"])]
