"""What a browser needs to draft on its own device: the drafter and the client code that runs it.

``GET /v1/edge/drafter/{model.onnx,meta.json}``: the drafter's self-contained export (``tandem drafter export
--self-contained``: token ids in, logits out, its tables inside), with an edge token or an API key as the other
device routes. ``GET /edge/client/edge.js``: the TypeScript client (clients/web) bundled for browsers;
``GET /edge/ort/<file>``: onnxruntime-web's module and WASM binaries, which the client drafts on. Both are static
code from the client's build (``npm ci && npm run build`` in clients/web) and need no credential; a gateway without
that build, or started without a browser drafter, answers 404 and says why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from .edge_sessions import Caller, download
from .errors import ApiError

router = APIRouter()
DRAFTER_FILES = ("model.onnx", "meta.json")
ORT_FILE = re.compile(r"ort[\w.-]*\.(mjs|wasm)")  # onnxruntime-web's modules and binaries, nothing else of the package
# (a module the client starts as a worker must itself say it embeds nothing unvetted, or the isolated page refuses it)
STATIC = {"Cache-Control": "public, max-age=3600", "X-Content-Type-Options": "nosniff",
          "Cross-Origin-Embedder-Policy": "require-corp", "Cross-Origin-Resource-Policy": "same-origin"}


def _file(path: Path | None, what: str, remedy: str) -> Path:
    if path is None or not path.is_file():
        raise ApiError(404, f"this gateway serves no {what} ({remedy})", code="not_found")
    return path


@router.get("/v1/edge/drafter/{name}")
async def drafter_file(name: str, request: Request, _: Caller = Depends(download)) -> Response:
    """A file of the drafter's self-contained export (``tandem serve --browser-drafter``). meta.json says which
    export it is (``export_id``: the export's folder, named by the model's digest, quantization and export version,
    and model.onnx's size and time), so a browser keeps model.onnx across visits and fetches it again only when that
    changes; the path the export was made from stays on the server."""
    export: Path | None = request.app.state.gateway.config.browser_drafter
    if name not in DRAFTER_FILES:
        raise ApiError(404, f"no drafter file {name!r}: {', '.join(DRAFTER_FILES)}", code="not_found")
    path = _file(export / name if export else None, "browser drafter", "start it with --browser-drafter")
    if name == "meta.json":
        meta = {k: v for k, v in json.loads(path.read_text()).items() if k != "source"}
        stat = (path.parent / "model.onnx").stat()
        meta["export_id"] = f"{path.parent.name}-{stat.st_size}-{stat.st_mtime_ns}"
        return JSONResponse(meta, headers={"Cache-Control": "no-cache"})
    return FileResponse(path, headers={"Cache-Control": "private, max-age=86400"},
                        media_type="application/octet-stream")


@router.get("/edge/client/edge.js", include_in_schema=False)
async def client_bundle(request: Request) -> FileResponse:
    web: Path | None = request.app.state.gateway.config.web_client
    path = _file(web / "dist" / "browser" / "edge.js" if web else None, "browser client",
                 "build clients/web: npm ci && npm run build")
    return FileResponse(path, media_type="text/javascript", headers=STATIC)


@router.get("/edge/ort/{name}", include_in_schema=False)
async def ort_file(name: str, request: Request) -> FileResponse:
    web: Path | None = request.app.state.gateway.config.web_client
    if not ORT_FILE.fullmatch(name):
        raise ApiError(404, f"no onnxruntime-web file {name!r}", code="not_found")
    path = _file(web / "node_modules" / "onnxruntime-web" / "dist" / name if web else None,
                 "onnxruntime-web", "npm ci in clients/web")
    return FileResponse(path, media_type="application/wasm" if name.endswith(".wasm") else "text/javascript",
                        headers=STATIC)
