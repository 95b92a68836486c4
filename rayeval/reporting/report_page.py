"""The results report's page: one HTML document holding the app (``report_app/``: its
scripts, one per view, and ``app.css``, inline) and, for ``rayeval report``, every view it
shows as JSON in a ``<script type="application/json">`` block. Nothing is fetched: no script,
style, font or image comes from elsewhere (images are data URIs), so the file can be mailed
and opened offline.
``rayeval view`` serves the same page without the views; the app then asks the server."""

from __future__ import annotations

import json
from html import escape
from importlib import resources

SHELL = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; {connect} img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{title}</title><style>{css}</style></head>
<body><header><h1 id="title">{title}</h1><div id="subtitle" class="muted"></div>
<nav id="nav"></nav></header><main id="main"><p class="muted">Loading...</p></main>
{views}<script>{js}</script></body></html>
"""


def _asset(name: str) -> str:
    return resources.files("rayeval.reporting").joinpath("report_app", name).read_text("utf-8")


# The app's files, one per view, joined in this order inside one function: they share its
# scope (report_app/app.js says what each holds).
APP = ("app.js", "board.js", "curves.js", "items.js", "compare.js", "about.js", "start.js")


def _app() -> str:
    return "(function () {\n  'use strict';\n" + "\n".join(_asset(n) for n in APP) + "})();\n"


def page(views: dict | None, title: str = "rayeval report") -> str:
    """The page: with ``views`` (name -> JSON-able) a self-contained report; without, the app
    that asks ``api/NAME`` of the server that serves it. The Content-Security-Policy forbids
    every request but the server's own (and none in a report file)."""
    block = ""
    if views is not None:
        block = ('<script id="rayeval-views" type="application/json">'
                 + embedded_json(views) + "</script>\n")
    return SHELL.format(title=escape(title), css=_asset("app.css"), js=_app(),
                        views=block,
                        connect="" if views is not None else "connect-src 'self';")


def embedded_json(value) -> str:
    """JSON that cannot end the script block it sits in: ``</`` written as ``<\\/`` (the same
    string to a JSON parser), and no NaN (not JSON)."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False, default=_default)
    return text.replace("</", "<\\/").replace("<!--", "<\\u0021--")


def _default(value):
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")
