"""The unsubscribe endpoint's pages: plain HTML from escaped strings, with the security headers
(no-store, noindex, no referrer, a CSP that forbids framing)."""

from __future__ import annotations

import html
from collections.abc import Mapping

from starlette.responses import HTMLResponse, Response

from mailflow.feedback.unsubscribe_tokens import ALL_MARKETING

_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Robots-Tag": "noindex, nofollow",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": ("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
}


def scope_label(scope: str) -> str:
    if scope == ALL_MARKETING:
        return "all marketing emails from us"
    return f"the \u201c{scope.replace('_', ' ')}\u201d emails"


def render_page(title: str, body_html: str, status: int, *, brand: str, head_only: bool = False,
          headers: Mapping[str, str] | None = None) -> Response:
    doc = (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<meta name=\"robots\" content=\"noindex, nofollow\">"
        f"<title>{html.escape(title)} \u2013 {html.escape(brand)}</title>"
        "<style>body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:34rem;"
        "margin:3rem auto;padding:0 1rem;color:#1f2933;line-height:1.5}"
        "button{font-size:1rem;padding:.6rem 1.2rem;border-radius:.4rem;border:0;background:#1f2933;"
        "color:#fff;cursor:pointer}label{display:block;margin:.4rem 0}.muted{color:#616e7c}</style>"
        f"</head><body><h1>{html.escape(title)}</h1>{body_html}"
        f"<p class=\"muted\">{html.escape(brand)}</p></body></html>\n"
    )
    all_headers = {**_SECURITY_HEADERS, **(headers or {})}
    if head_only:
        return Response(b"", status_code=status, headers=all_headers, media_type="text/html; charset=utf-8")
    return HTMLResponse(doc, status_code=status, headers=all_headers)


def confirm_form(scope: str) -> str:
    # no action attribute: the form posts to the page's own URL, whatever prefix it is mounted under
    widen = "" if scope == ALL_MARKETING else (
        "<label><input type=\"checkbox\" name=\"scope\" value=\"all\"> "
        "Also stop all other marketing emails</label>")
    return ("<form method=\"post\"><input type=\"hidden\" name=\"confirm\" value=\"yes\">"
            f"{widen}<p><button type=\"submit\">Unsubscribe</button></p></form>")
