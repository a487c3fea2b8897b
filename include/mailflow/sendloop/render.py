"""Render a chunk of minted rows into one deterministic ``POST /emails/batch`` request body.

Determinism is what makes retries safe: the same rows and templates always give the same bytes,
so a retry under the same Idempotency-Key is accepted by the provider as the same request
(Resend: same key + different payload = 409). Templates are Jinja2 in the sandbox (subjects
included; :mod:`mailflow.campaigns.templating`) with autoescape on for HTML, ``StrictUndefined``
(a missing variable is an error naming the template), no clock or randomness.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import jinja2
import jinja2.bccache
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import SandboxedEnvironment

from mailflow.campaigns import Campaign, CampaignFolder
from mailflow.campaigns.templating import fixed_blocks, sandboxed_env, subject_template
from mailflow.model.keys import idempotency_key
from mailflow.model.outcome import MintedRow, PreparedBatch

if TYPE_CHECKING:  # the renderer only calls signer.token(): no import of the feedback stage
    from mailflow.feedback.unsubscribe_tokens import UnsubscribeSigner


class RenderError(ValueError):
    """A row could not be rendered; the message names the campaign, the row and the reason."""


MAILTO_ENV = "MAILFLOW_UNSUBSCRIBE_MAILTO"
_MAILTO = re.compile(r"^[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?$")


def _autoescape(name: str | None) -> bool:
    return bool(name) and ".html" in str(name)


class _CompiledTemplates(jinja2.BytecodeCache):
    """The compiled code of every campaign template this process has loaded, in memory, keyed by
    the template's name and file and checked against the sha1 of its source (Jinja2's bucket
    checksum): a template is parsed and compiled once per process, and an edited file, whose source
    no longer matches, is compiled again by the next renderer that loads it. Only
    :func:`template_env` uses it, so every entry was compiled with the same environment settings
    (sandbox, autoescape by name, trailing newline), which the generated code depends on."""

    def __init__(self) -> None:
        self._code: dict[str, tuple[str | None, Any]] = {}

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        hit = self._code.get(bucket.key)
        if hit is not None and hit[0] == bucket.checksum:
            bucket.code = hit[1]

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        self._code[bucket.key] = (bucket.checksum, bucket.code)


_COMPILED = _CompiledTemplates()


def template_env(templates_dir: Path | None = None) -> jinja2.Environment:
    """Jinja2 environment for campaign templates: sandboxed (see :mod:`mailflow.campaigns.templating`),
    HTML autoescaped, text not, strict undefined.

    :param templates_dir: default: ``templates/`` of the resolved campaigns folder
        (:meth:`mailflow.campaigns.CampaignFolder.resolve`).
    """
    # an environment lives as long as its renderer (one run): each template is read once, on first
    # use, with no stat() per email (auto_reload off); the next run's renderer reads the files again
    # and reuses the compiled code of every file whose source is unchanged (_COMPILED)
    env = sandboxed_env(jinja2.FileSystemLoader(str(templates_dir or CampaignFolder.resolve().templates_dir)),
                        autoescape=_autoescape)
    env.bytecode_cache = _COMPILED
    return env


#: Context names that are the same for every email of a campaign in one renderer: a subject that
#: reads nothing else renders to the same text for every row.
_PER_CAMPAIGN = frozenset({"campaign", "app_url"})
#: The other context names of :meth:`Renderer.render_email`: they differ per email.
_ROW_NAMES = frozenset({"user", "unsubscribe_url"})


class _FixedBlocks:
    """The blocks of one campaign's template whose text is the same for every email
    (:func:`mailflow.campaigns.templating.fixed_blocks`: the layout's header, call to action and
    footer pieces that read only per-campaign names), each rendered once, in the sandbox, by the
    first email that needs it, then given to every later email's context as that text.

    A Jinja2 block is a generator of text pieces called with the render's context; the stand-in
    yields the joined text of the first call, which is what each caller (the layout's ``{% block %}``
    or ``self.name()``) joins again: the bytes of the email are those of a plain render."""

    def __init__(self, template: jinja2.Template, names: frozenset[str]):
        self._concat = template.environment.concat
        self._names = names
        self._text: dict[str, str] = {}
        self._stand_ins: dict[str, Callable[[Any], Iterator[str]]] = {}

    def install(self, context: Any) -> None:
        """Put the stand-ins first in ``context.blocks``, before the template's root runs. Behind
        each stand-in come the definitions Jinja2 keeps for the block (the template's own, then
        the layouts', which their roots append while rendering): the one right behind it is the
        definition that renders, called by the stand-in the first time."""
        for name in self._names:
            stand_in = self._stand_ins.get(name)
            if stand_in is None:
                stand_in = self._stand_ins[name] = self._stand_in(name)
            context.blocks[name] = [stand_in, *context.blocks.get(name, ())]

    def _stand_in(self, name: str) -> Callable[[Any], Iterator[str]]:
        def block(context: Any) -> Iterator[str]:
            text = self._text.get(name)
            if text is None:
                text = self._text[name] = self._concat(context.blocks[name][1](context))
            yield text

        return block


def _same_for_every_email(text: str) -> bool:
    """Whether a subject template's output cannot depend on the row: it reads no context name but
    :data:`_PER_CAMPAIGN` (no ``user``, no ``unsubscribe_url``, no global such as ``lipsum`` or
    ``cycler``) and uses no ``random`` filter."""
    tree = sandboxed_env().parse(text)
    if any(f.name == "random" for f in tree.find_all(jinja2.nodes.Filter)):
        return False
    return jinja2.meta.find_undeclared_variables(tree) <= _PER_CAMPAIGN


class Renderer:
    """Turn minted rows into a :class:`PreparedBatch`.

    :param signer: signs per-user unsubscribe tokens.
    :param public_url: base URL of the unsubscribe endpoint (``MAILFLOW_PUBLIC_URL``), e.g.
        ``https://mail.example.com``; links are ``<public_url>/u/<token>``.
    :param app_url: base URL of the product, for calls to action in templates.
    :param mailto: an address that also accepts unsubscribes by email (RFC 2369): added to
        ``List-Unsubscribe`` after the HTTPS link as ``<mailto:ADDR?subject=unsubscribe%20TOKEN>``.
        ``None`` reads ``MAILFLOW_UNSUBSCRIBE_MAILTO`` once, here (unset or empty: no mailto); ``""``
        turns it off. Someone must process that mailbox (see docs/unsubscribe.md).
    :param issued_on: the UTC issue date put into every token (v2 tokens, which expire when the
        verifier sets a maximum age); ``None`` (default): v1 tokens without a date. A fixed input,
        never the clock, so rendering stays deterministic.
    :param env: the templates' environment (default :func:`template_env`); it must be sandboxed.
    :raises ValueError: if the mailto address is not a plain ``local@domain`` address.
    :raises TypeError: if ``env`` is not a :class:`jinja2.sandbox.SandboxedEnvironment`.
    """

    def __init__(self, signer: UnsubscribeSigner, public_url: str, app_url: str, env: jinja2.Environment | None = None,
                 *, mailto: str | None = None, issued_on: date | None = None):
        self.signer = signer
        self.public_url = public_url.rstrip("/")
        self.app_url = app_url.rstrip("/")
        if env is not None and not isinstance(env, SandboxedEnvironment):
            raise TypeError("campaign templates render only in a sandboxed environment (template_env())")
        self.env = env or template_env()
        self._subjects: dict[str, jinja2.Template] = {}
        # campaign -> its subject line when that is the same for every email (_same_for_every_email):
        # rendered once, in the sandbox, from the first row's context; None: rendered per email
        self._fixed_subjects: dict[str, str | None] = {}
        # (campaign, template name) -> compiled template and its fixed blocks (_FixedBlocks):
        # get_template() per email stats the file twice (Jinja2's auto_reload) and looks it up in
        # the cache; a run renders thousands
        self._templates: dict[tuple[str, str], tuple[jinja2.Template, _FixedBlocks]] = {}
        address = (os.environ.get(MAILTO_ENV, "") if mailto is None else mailto).strip()
        address = address[len("mailto:"):] if address.lower().startswith("mailto:") else address
        if address and not _MAILTO.match(address):
            raise ValueError(f"unsubscribe mailto {address!r} ({MAILTO_ENV}) must be a plain local@domain address")
        self.mailto = address or None
        self.issued_on = issued_on

    def render_email(self, campaign: Campaign, row: MintedRow) -> dict[str, Any]:
        """Return one Resend email object for ``row`` (keys: from, to, subject, html, text, headers,
        reply_to?, tags).

        :raises jinja2.UndefinedError: naming the variable when a template needs a missing column.
        """
        token = self.signer.token(row.user_id, campaign.name, issued=self.issued_on)
        unsubscribe_url = f"{self.public_url}/u/{token}"
        ctx = {
            "user": {"user_id": row.user_id, "email": row.email, **row.context},
            "campaign": campaign.name,
            "unsubscribe_url": unsubscribe_url,
            "app_url": self.app_url,
        }
        subject = self._fixed_subjects.get(campaign.name)
        if subject is None:
            subject_t = self._subjects.get(campaign.name)
            if subject_t is None:
                subject_t = self._subjects[campaign.name] = subject_template(campaign.subject)
            subject = " ".join(subject_t.render(ctx).split())
            if campaign.name not in self._fixed_subjects:
                self._fixed_subjects[campaign.name] = subject if _same_for_every_email(campaign.subject) else None
        headers = {"X-Mailflow-Send-Id": str(row.id), "X-Mailflow-Campaign": campaign.name}
        if campaign.marketing:
            # RFC 8058 one-click: an HTTPS URI that identifies the recipient by itself (first), then
            # an optional mailto (RFC 2369) for clients that only send email.
            headers["List-Unsubscribe"] = f"<{unsubscribe_url}>"
            if self.mailto:
                headers["List-Unsubscribe"] += f", <mailto:{self.mailto}?subject={quote('unsubscribe ' + token)}>"
            headers["List-Unsubscribe-Post"] = "List-Unsubscribe=One-Click"
        email: dict[str, Any] = {
            "from": campaign.from_address,
            "to": [row.email],
            "subject": subject,
            "html": self._render(campaign, "html", ctx),
            "text": self._render(campaign, "txt", ctx),
            "headers": headers,
            "tags": [{"name": "campaign", "value": campaign.name}],
        }
        if campaign.reply_to:
            email["reply_to"] = campaign.reply_to
        return email

    def _render(self, campaign: Campaign, kind: str, ctx: dict[str, Any]) -> str:
        """``Template.render(ctx)`` of the campaign's ``kind`` template, with its fixed blocks'
        text from the campaign's first email (:class:`_FixedBlocks`)."""
        name = f"{campaign.template}.{kind}.j2"
        found = self._templates.get((campaign.name, name))
        if found is None:
            template = self.env.get_template(name)
            found = self._templates[(campaign.name, name)] = (
                template, _FixedBlocks(template, fixed_blocks(self.env, name, _ROW_NAMES)))
        template, fixed = found
        context = template.new_context(ctx)
        fixed.install(context)
        try:
            return template.environment.concat(template.root_render_func(context))
        except Exception:
            template.environment.handle_exception()  # as Template.render: raises the error, rewritten
            raise  # not reached

    def prepare_batch(self, campaign: Campaign, rows: Sequence[MintedRow]) -> PreparedBatch:
        """Render ``rows`` (in the given order: request index i = rows[i]) into one batch.

        :raises RenderError: naming the campaign, the template and the user when a row cannot be
            rendered (e.g. a template variable its audience does not provide). Raised inside the
            mint transaction, so the chunk is not minted; earlier chunks stay recorded.
        """
        emails = []
        for r in rows:
            try:
                emails.append(self.render_email(campaign, r))
            except (jinja2.TemplateError, ValueError, TypeError) as exc:
                raise RenderError(f"campaign {campaign.name!r}: cannot render the email for user {r.user_id} "
                                  f"(template {campaign.template!r}; chunk not minted): "
                                  f"{type(exc).__name__}: {exc}") from exc
        body = json.dumps(emails, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
        ids = tuple(r.id for r in rows)
        return PreparedBatch(idempotency_key=idempotency_key(campaign.name, ids), campaign=campaign.name, row_ids=ids,
                             body=body, content_hash=campaign.content_hash)
