"""The optimised renderer (compiled code kept per process, a fixed subject rendered once, fixed
blocks rendered once per campaign, the signer's key state derived once) gives exactly the bytes of
a straightforward render: a fresh plain sandboxed Jinja2 environment per email, the HMAC of the
token spelled out, the JSON of the docs. A key is never sent with two bodies, so any difference
in bytes for the same inputs is a bug."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from datetime import date, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mailflow.campaigns import Campaign, load_campaigns
from mailflow.campaigns.templating import fixed_blocks
from mailflow.feedback.unsubscribe_tokens import day_number, signer_from_secret
from mailflow.model.outcome import MintedRow
from mailflow.sendloop.render import Renderer, RenderError, template_env
from mailflow.store.policy import _normalised, normalise_address

SECRET = "identity-secret-0123456789abcdef"
PUBLIC = "https://mail.example.com"
APP = "https://app.example.com"
ROW_NAMES = frozenset({"user", "unsubscribe_url"})


def examples_dir() -> Path:
    from mailflow.campaigns import CampaignFolder

    return CampaignFolder.resolve().templates_dir


def reference_token(user_id: int, list_id: str, issued: date | None, secret: str = SECRET, kid: str = "k1") -> str:
    """The token as the module docstring of unsubscribe_tokens defines it, computed from scratch."""
    if issued is None:
        msg = f"{kid}.{user_id}.{list_id}".encode()
    else:
        msg = b"mailflow-unsubscribe-v2|" + f"{kid}.{user_id}.{list_id}.{day_number(issued)}".encode()
    sig = base64.b32encode(hmac.new(secret.encode(), msg, hashlib.sha256).digest()[:16]).decode().rstrip("=").lower()
    return f"{kid}.{user_id}.{list_id}.{sig}" if issued is None else f"{kid}.{user_id}.{list_id}.{day_number(issued)}.{sig}"


def plain_env(templates_dir: Path) -> jinja2.Environment:
    """A plain sandboxed environment: Jinja2's own class, no shared compiled code, no lookups kept."""
    return ImmutableSandboxedEnvironment(loader=jinja2.FileSystemLoader(str(templates_dir)),
                                         autoescape=lambda name: bool(name) and ".html" in name,
                                         undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def reference_body(campaign: Campaign, rows: list[MintedRow], templates_dir: Path, *, mailto: str | None = None,
                   issued: date | None = None) -> bytes:
    emails = []
    for row in rows:
        env = plain_env(templates_dir)  # a fresh environment per email: nothing carried over
        token = reference_token(row.user_id, campaign.name, issued)
        url = f"{PUBLIC}/u/{token}"
        ctx = {"user": {"user_id": row.user_id, "email": row.email, **row.context}, "campaign": campaign.name,
               "unsubscribe_url": url, "app_url": APP}
        headers = {"X-Mailflow-Send-Id": str(row.id), "X-Mailflow-Campaign": campaign.name}
        if campaign.marketing:
            headers["List-Unsubscribe"] = f"<{url}>"
            if mailto:
                headers["List-Unsubscribe"] += f", <mailto:{mailto}?subject={quote('unsubscribe ' + token)}>"
            headers["List-Unsubscribe-Post"] = "List-Unsubscribe=One-Click"
        email: dict[str, Any] = {
            "from": campaign.from_address, "to": [row.email],
            "subject": " ".join(env.from_string(campaign.subject).render(ctx).split()),
            "html": env.get_template(f"{campaign.template}.html.j2").render(ctx),
            "text": env.get_template(f"{campaign.template}.txt.j2").render(ctx),
            "headers": headers, "tags": [{"name": "campaign", "value": campaign.name}]}
        if campaign.reply_to:
            email["reply_to"] = campaign.reply_to
        emails.append(email)
    return json.dumps(emails, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()


NAMES = ["Anna", None, "", "  Ben  ", "<b>Clara</b> & co", "Zoë \"Z\" O'Neil", "İlkay", "x" * 80]
KINDS = ["numerical", "abstract_reasoning", None, "situational_judgement", "<i>verbal</i>"]


def sample_rows(n: int, first_id: int = 7000) -> list[MintedRow]:
    """Users whose context varies in every field a template reads (names with markup, quotes,
    non-ASCII, empty and missing; kinds starting with a vowel or not; missing scores)."""
    return [MintedRow(id=first_id + i, user_id=900_000 + 37 * i, email=f"User.{i}@Example.COM", context={
        "first_name": NAMES[i % len(NAMES)], "assessment_id": 40 + i, "assessment_kind": KINDS[i % len(KINDS)],
        "free_tests_finished": i % 4, "best_score": None if i % 3 == 0 else 50 + i, "recent_kind": KINDS[(i + 1) % 5],
    }) for i in range(n)]


def campaign(name: str, template: str, subject: str = "Hello", marketing: bool = True) -> Campaign:
    return Campaign(name=name, priority=1, audience_sql="select 1", template=template, subject=subject,
                    from_address="Team <team@mail.example.com>", reply_to=None, cooldown=timedelta(days=1),
                    audience_window=timedelta(days=1), marketing=marketing)


@pytest.mark.parametrize("mailto, issued", [(None, None), ("unsub@mail.example.com", date(2026, 12, 3))])
def test_every_example_campaign_renders_the_bytes_of_a_plain_render(mailto: str | None, issued: date | None) -> None:
    templates = examples_dir()
    r = Renderer(signer_from_secret(SECRET), PUBLIC, APP, mailto=mailto or "", issued_on=issued)
    rows = sample_rows(40)
    campaigns = load_campaigns()
    assert len(campaigns) == 4
    for c in campaigns:
        for part in (rows[:17], rows[17:]):  # two chunks: the second reuses what the first fixed
            assert r.prepare_batch(c, part).body == reference_body(c, part, templates, mailto=mailto, issued=issued), \
                c.name
    # the scheduled template, through the same renderer
    outreach = campaign("spring_news", "outreach", subject="{{ user.first_name or 'Hi' }}: the library")
    assert r.prepare_batch(outreach, rows).body == reference_body(outreach, rows, templates, mailto=mailto,
                                                                  issued=issued)


def test_the_layouts_fixed_blocks_are_the_ones_that_read_no_row() -> None:
    env = template_env()
    assert fixed_blocks(env, "upgrade_offer.html.j2", ROW_NAMES) == {"preheader", "cta_url", "cta_label", "reason"}
    assert fixed_blocks(env, "upgrade_offer.txt.j2", ROW_NAMES) == {"cta_url", "cta_label", "reason"}
    # kind and a_kind come from user.assessment_kind; cta_url reads user.assessment_id
    assert fixed_blocks(env, "finish_assessment.html.j2", ROW_NAMES) == {"cta_label"}
    assert fixed_blocks(env, "first_practice.html.j2", ROW_NAMES) == {"preheader", "content", "cta_url",
                                                                      "cta_label", "reason"}


TRICKY = {
    "_base.html.j2": (
        "{% set brand = app_name | default('Brand') %}{% set base = app_url.rstrip('/') %}"
        "{% if user.first_name %}{% set greeting = 'Hi ' ~ user.first_name %}{% endif %}"
        "<h1>{% block head %}{{ brand }} &amp; {{ '<x>' }}{% endblock %}</h1>"
        "<p>{% block layout_only %}{{ base }}/home{% endblock %}</p>"
        "<p>{% block calls_self %}[{{ self.head() }}]{% endblock %}</p>"
        "<p>{% block uses_greeting %}{{ greeting | default('none') }}{% endblock %}</p>"
        "{% for i in range(2) %}<i>{% block in_loop scoped %}{{ i }}{% endblock %}</i>{% endfor %}"
        "<p>{% block outer %}o{% block inner %}in{% endblock %}{% endblock %}</p>"
        "<p>{% block with_super %}S{% endblock %}</p>"
        "<p>{% block globals %}{{ range(3) | list }}{% endblock %}</p>"
        "<p>{% block local_from_user %}{% set n = user.user_id %}{{ n }}{% endblock %}</p>"
        "<p>{% block row_url %}{{ unsubscribe_url }}{% endblock %}</p>"
        "<p>{% block campaign_name %}{{ campaign | upper }}{% endblock %}</p>"),
    "_mid.html.j2": "{% extends '_base.html.j2' %}{% block with_super %}{{ super() }}+{{ user.email }}{% endblock %}",
    "tricky.html.j2": (
        "{% extends '_mid.html.j2' %}{% set label = campaign ~ '!' %}"
        "{% block head %}{{ label }} {{ brand }}{% endblock %}{% block inner %}{{ user.first_name }}{% endblock %}"),
    "tricky.txt.j2": "{% block only %}{{ app_url }}{% endblock %} {{ user.first_name or 'there' }}\n",
}


def test_fixed_blocks_are_found_conservatively_and_render_the_same_bytes(tmp_path: Path) -> None:
    for name, text in TRICKY.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    env = template_env(tmp_path)
    # head: campaign and brand only (label and brand are plain top-level sets of per-campaign names);
    # layout_only: base = app_url.rstrip('/'); campaign_name: a filter of a per-campaign name.
    # Not fixed: self.head() (self), greeting (set inside an if), scoped in a loop, a block holding
    # a block, super() (defined in _mid, the definition that renders), range (a global),
    # a local from user, the row's URL.
    assert fixed_blocks(env, "tricky.html.j2", ROW_NAMES) == {"head", "layout_only", "campaign_name"}
    assert fixed_blocks(env, "tricky.txt.j2", ROW_NAMES) == {"only"}
    c = campaign("tricky_one", "tricky")
    rows = sample_rows(9)
    r = Renderer(signer_from_secret(SECRET), PUBLIC, APP, env=env, mailto="")
    for part in (rows[:4], rows[4:]):
        assert r.prepare_batch(c, part).body == reference_body(c, part, tmp_path)
    emails = json.loads(r.prepare_batch(c, rows[:2]).body)
    assert emails[0]["html"].startswith("<h1>tricky_one! Brand</h1><p>https://app.example.com/home</p>"
                                        "<p>[tricky_one! Brand]</p><p>Hi Anna</p><i>0</i><i>1</i><p>oAnna</p>")
    assert "<p>S+User.0@Example.COM</p>" in emails[0]["html"] and "<p>S+User.1@Example.COM</p>" in emails[1]["html"]


def test_a_fixed_block_that_leaves_the_sandbox_fails_every_email(tmp_path: Path) -> None:
    (tmp_path / "escape.html.j2").write_text("{% block b %}{{ app_url.__class__.__mro__ }}{% endblock %}")
    (tmp_path / "escape.txt.j2").write_text("plain")
    env = template_env(tmp_path)
    assert fixed_blocks(env, "escape.html.j2", ROW_NAMES) == {"b"}
    r = Renderer(signer_from_secret(SECRET), PUBLIC, APP, env=env, mailto="")
    c = campaign("escaping", "escape")
    for row in sample_rows(2):  # the refusal is not rendered once and forgotten
        with pytest.raises(RenderError, match="SecurityError|UndefinedError|unsafe"):
            r.prepare_batch(c, [row])


def test_an_edited_template_is_compiled_again_by_the_next_renderer(tmp_path: Path) -> None:
    (tmp_path / "edit.html.j2").write_text("{% block b %}one {{ campaign }}{% endblock %}")
    (tmp_path / "edit.txt.j2").write_text("text")
    c = campaign("edited", "edit")
    row = sample_rows(1)
    first = Renderer(signer_from_secret(SECRET), PUBLIC, APP, env=template_env(tmp_path), mailto="")
    assert json.loads(first.prepare_batch(c, row).body)[0]["html"] == "one edited"
    path = tmp_path / "edit.html.j2"
    stat = path.stat()
    path.write_text("{% block b %}two {{ campaign }}{% endblock %}")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime: the source decides, not the clock
    second = Renderer(signer_from_secret(SECRET), PUBLIC, APP, env=template_env(tmp_path), mailto="")
    assert json.loads(second.prepare_batch(c, row).body)[0]["html"] == "two edited"
    assert second.prepare_batch(c, row).body == reference_body(c, row, tmp_path)


def test_a_subject_that_reads_the_row_is_rendered_per_email(tmp_path: Path) -> None:
    r = Renderer(signer_from_secret(SECRET), PUBLIC, APP, mailto="")
    base = load_campaigns()[0]
    fixed = campaign("fixed_subject", base.template, subject="  Same   for {{ campaign }}  ")
    per_row = campaign("row_subject", base.template, subject="{{ user.first_name or 'you' }} {{ unsubscribe_url[-4:] }}")
    random = campaign("random_subject", base.template, subject="{{ ['a', 'b'] | random }}")
    rows = sample_rows(6)
    assert {e["subject"] for e in json.loads(r.prepare_batch(fixed, rows).body)} == {"Same for fixed_subject"}
    subjects = [e["subject"] for e in json.loads(r.prepare_batch(per_row, rows).body)]
    assert len(set(subjects)) == 6
    assert r.prepare_batch(per_row, rows).body == reference_body(per_row, rows, examples_dir())
    assert r._fixed_subjects == {"fixed_subject": "Same for fixed_subject", "row_subject": None}
    r.prepare_batch(random, rows[:1])
    assert r._fixed_subjects["random_subject"] is None


@pytest.mark.parametrize("issued", [None, date(2026, 1, 31)])
def test_tokens_are_the_hmac_of_the_spec_for_every_key(issued: date | None) -> None:
    for secret, kid in ((SECRET, "k1"), ("another-secret-0123456789", "k7"), (SECRET + "x", "abc")):
        signer = signer_from_secret(secret, kid=kid)
        for uid in (0, 1, 42, 10**17 + 3):
            for list_id in ("all", "first_practice"):
                token = signer.token(uid, list_id, issued=issued)
                assert token == reference_token(uid, list_id, issued, secret=secret, kid=kid)
                assert signer.verify(token, today=date(2026, 2, 1)) == (uid, list_id)


def test_the_address_cache_gives_what_the_validator_gives() -> None:
    texts = ["User@Example.COM", " user@example.com ", "ΟΔΟΣ@example.gr", "a@b", "", None, "no-at-sign",
             "x@münchen.de", "Straße@Example.com", "a..b@example.com"]
    for text in texts:
        cached = normalise_address(text)
        assert cached == _normalised.__wrapped__(text), text
        assert normalise_address(text) is cached  # the second call is the first one's result
