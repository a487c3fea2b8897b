"""Integration tests for the demo data loader, the lifecycle audience SQL and the campaign templates.

Needs the test PostgreSQL server (``pg_admin_dsn`` in conftest: TEST_DATABASE_URL or the
embedded default). Each module run creates throwaway ``mailflow_demo_<hex>`` databases and drops
them afterwards.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import jinja2
import psycopg
import pytest
from psycopg.rows import dict_row

from mailflow.sendloop.render import template_env
from mailflow_dev.demo import LoadSummary, load_demo_data
from mailflow_dev.demo.__main__ import main as demo_cli

ANCHOR = datetime(2025, 3, 10, 12, 0, tzinfo=UTC)
USERS = 5000
SEED = 42
# Malformed addresses for the default seed (5,000 users): independent of Faker's name lists
# and of the anchor, since the address stream draws the same number of values per user.
EXPECTED_MALFORMED = 58

MAILFLOW = Path(__file__).resolve().parents[3] / "include" / "mailflow"
AUDIENCES = MAILFLOW / "campaigns" / "audiences"
TEMPLATES = MAILFLOW / "campaigns" / "templates"

#: Audience windows of lifecycle.toml, ending at the anchor.
WINDOWS = {
    "finish_assessment": timedelta(days=2),
    "first_practice": timedelta(days=2),
    "upgrade_offer": timedelta(days=14),
    "practice_tips": timedelta(days=7),
}
CAMPAIGNS = list(WINDOWS)
EXTRA_COLUMNS = {
    "finish_assessment": ["assessment_id", "assessment_kind"],
    "first_practice": [],
    "upgrade_offer": ["free_tests_finished", "best_score"],
    "practice_tips": ["recent_kind"],
}


# --------------------------------------------------------------------------- fixtures


@contextmanager
def _scratch_db(admin: psycopg.Connection[Any]) -> Iterator[str]:
    name = f"mailflow_demo_{uuid.uuid4().hex[:12]}"
    admin.execute(f'create database "{name}"')
    try:
        yield psycopg.conninfo.make_conninfo(admin.info.dsn, dbname=name)
    finally:
        admin.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture(scope="module")
def admin(pg_admin_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_admin_dsn, autocommit=True, connect_timeout=5) as conn:
        yield conn


@pytest.fixture(scope="module")
def demo(admin: psycopg.Connection[Any]) -> Iterator[tuple[str, LoadSummary]]:
    """A database loaded with the default demo data: (dsn, summary)."""
    with _scratch_db(admin) as dsn:
        with psycopg.connect(dsn) as conn:
            summary = load_demo_data(conn, users=USERS, seed=SEED, anchor=ANCHOR)
        yield dsn, summary


@pytest.fixture(scope="module")
def conn(demo: tuple[str, LoadSummary]) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(demo[0], autocommit=True, row_factory=dict_row) as c:
        yield c


@pytest.fixture(scope="module")
def tables(conn: psycopg.Connection[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    users = conn.execute("select * from app.users order by user_id").fetchall()
    assessments = conn.execute("select * from app.assessments order by assessment_id").fetchall()
    return users, assessments


def _dump(dsn: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as c:
        return (
            c.execute("select * from app.users order by user_id").fetchall(),
            c.execute("select * from app.assessments order by assessment_id").fetchall(),
        )


# --------------------------------------------------------------------------- loader


def test_load_summary_matches_tables(demo: tuple[str, LoadSummary], conn: psycopg.Connection[Any]) -> None:
    _, summary = demo
    assert summary.loaded and not summary.reset
    assert summary.users == USERS
    counts = conn.execute(
        "select (select count(*) from app.users) as users,"
        " (select count(*) from app.assessments) as assessments,"
        " (select count(*) from app.users where plan = 'pro') as pro"
    ).fetchone()
    assert counts == {"users": summary.users, "assessments": summary.assessments, "pro": summary.pro_users}
    assert 0.05 <= summary.pro_users / USERS <= 0.11  # "about 8% pay"
    assert summary.malformed_emails == EXPECTED_MALFORMED
    assert summary.elapsed_s >= 0.0  # speed is measured by the benchmarks, not here
    assert summary.anchor == ANCHOR and summary.seed == SEED
    assert str(summary) == summary.message


def test_same_seed_and_anchor_give_identical_rows(
    admin: psycopg.Connection[Any], demo: tuple[str, LoadSummary]
) -> None:
    first = _dump(demo[0])
    with _scratch_db(admin) as dsn:
        with psycopg.connect(dsn) as c:
            summary = load_demo_data(c, users=USERS, seed=SEED, anchor=ANCHOR)
        assert summary.loaded
        second = _dump(dsn)
        assert second[0] == first[0]
        assert second[1] == first[1]

        # A different seed gives different data (sanity check of the comparison).
        with psycopg.connect(dsn) as c:
            other = load_demo_data(c, users=USERS, seed=SEED + 1, anchor=ANCHOR, reset=True)
        assert other.loaded and other.reset
        assert _dump(dsn)[0] != first[0]


def test_second_load_is_a_no_op_and_reset_reloads(
    admin: psycopg.Connection[Any], demo: tuple[str, LoadSummary]
) -> None:
    dsn, first = demo
    before = _dump(dsn)
    with psycopg.connect(dsn) as c:
        again = load_demo_data(c, users=10, seed=7, anchor=ANCHOR + timedelta(days=3))
    assert not again.loaded
    assert (again.users, again.assessments, again.pro_users) == (
        first.users,
        first.assessments,
        first.pro_users,
    )
    assert "nothing loaded" in again.message
    assert _dump(dsn) == before

    with _scratch_db(admin) as scratch:
        with psycopg.connect(scratch) as c:
            small = load_demo_data(c, users=50, seed=1, anchor=ANCHOR)
            assert small.loaded and small.users == 50
            reloaded = load_demo_data(c, users=80, seed=1, anchor=ANCHOR, reset=True)
            assert reloaded.loaded and reloaded.reset
            assert c.execute("select count(*) from app.users").fetchone() == (80,)


def test_cli_loads_then_skips(admin: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]) -> None:
    with _scratch_db(admin) as dsn:
        args = ["--dsn", dsn, "--users", "120", "--seed", "3", "--anchor", "2025-03-10T12:00:00Z"]
        assert demo_cli(args) == 0
        assert "loaded 120 users" in capsys.readouterr().out
        assert demo_cli(args) == 0
        assert "nothing loaded" in capsys.readouterr().out
        assert demo_cli([*args, "--reset", "--users", "30"]) == 0
        assert "loaded 30 users" in capsys.readouterr().out


def test_naive_anchor_is_rejected(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(ValueError, match="aware"):
        load_demo_data(conn, anchor=datetime(2025, 3, 10, 12))


def test_data_is_realistic_and_consistent(tables: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> None:
    users, assessments = tables
    assert [u["user_id"] for u in users] == list(range(1, USERS + 1))
    by_id = {u["user_id"]: u for u in users}
    for u in users:
        assert ANCHOR - timedelta(days=14) <= u["signed_up_at"] < ANCHOR
        assert u["plan"] in ("free", "pro")
        ZoneInfo(u["timezone"])  # a valid IANA name
        if u["last_active_at"] is not None:
            assert u["signed_up_at"] <= u["last_active_at"] < ANCHOR
    signups = [u["signed_up_at"] for u in users]
    assert signups == sorted(signups)  # user_id follows sign-up order
    # Names: a locale mix, a few missing or empty first names.
    assert any(u["timezone"] == "Europe/Berlin" for u in users)
    assert any(u["timezone"] == "Europe/Paris" for u in users)
    assert any(u["timezone"] == "Europe/London" for u in users)
    assert any(u["timezone"].startswith("America/") for u in users)
    assert 0 < sum(1 for u in users if not (u["first_name"] or "").strip()) < USERS * 0.1

    assert [a["assessment_id"] for a in assessments] == list(range(1, len(assessments) + 1))
    for a in assessments:
        user = by_id[a["user_id"]]
        assert user["signed_up_at"] <= a["started_at"] < ANCHOR
        assert user["last_active_at"] is not None and a["started_at"] <= user["last_active_at"]
        if a["finished_at"] is None:
            assert a["score"] is None
        else:
            assert a["started_at"] <= a["finished_at"] < ANCHOR
            assert 0 <= a["score"] <= 100
            assert a["finished_at"] <= user["last_active_at"]
        if user["plan"] == "free":
            assert a["is_free"]
    started = {a["user_id"] for a in assessments}
    finished = {a["user_id"] for a in assessments if a["finished_at"] is not None}
    assert 0.6 * USERS < len(started) < 0.9 * USERS  # some never start
    assert len(started - finished) > 0.03 * USERS  # some start and never finish
    assert {a["kind"] for a in assessments} >= {"numerical", "verbal", "logical", "diagrammatic"}
    quiet = [
        u
        for u in users
        if u["last_active_at"] is not None and u["last_active_at"] < ANCHOR - timedelta(days=5)
    ]
    assert len(quiet) > 0.1 * USERS  # some go quiet


MALFORMED_PATTERNS = {
    "double @": re.compile(r"@.*@"),
    "space": re.compile(r"\s"),
    "no dot in domain": re.compile(r"@[^.@]+$"),
    "trailing dot": re.compile(r"\.$"),
    "'..' in local part": re.compile(r"\.\..*@"),
    "comma": re.compile(r","),
}


def test_malformed_and_odd_addresses(tables: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> None:
    email_validator = pytest.importorskip("email_validator")
    users, _ = tables
    emails = [u["email"] for u in users]
    assert len({e.lower() for e in emails}) == len(emails)  # unique, case-insensitively

    invalid = []
    for e in emails:
        try:
            email_validator.validate_email(e, check_deliverability=False)
        except email_validator.EmailNotValidError:
            invalid.append(e)
    assert 0.005 * USERS <= len(invalid) <= 0.015 * USERS
    assert len(invalid) == EXPECTED_MALFORMED
    for label, pattern in MALFORMED_PATTERNS.items():
        assert any(pattern.search(e) for e in invalid), f"no malformed address with {label}"
    assert all(any(p.search(e) for p in MALFORMED_PATTERNS.values()) for e in invalid)

    valid = [e for e in emails if e not in set(invalid)]
    assert any("+" in e.split("@")[0] for e in valid), "no plus tag"
    assert any(e != e.lower() for e in valid), "no upper case"
    assert any(e.split("@")[1].count(".") >= 2 for e in valid), "no subdomain"
    domains = {e.rsplit("@", 1)[1].lower().rstrip(".") for e in emails}
    assert all(d == "localhost" or re.search(r"(^|\.)example\.(com|org|net)$", d) for d in domains), domains


# --------------------------------------------------------------------------- audiences


def _audience_sql(name: str) -> str:
    return (AUDIENCES / f"{name}.sql").read_text(encoding="utf-8")


def _in(t: datetime | None, start: datetime, end: datetime) -> bool:
    return t is not None and start <= t < end


def expected_audience(
    name: str,
    users: list[dict[str, Any]],
    assessments: list[dict[str, Any]],
    start: datetime,
    end: datetime,
) -> dict[int, dict[str, Any]]:
    """Each campaign's rule computed in Python from the app rows: user_id -> row."""
    by_id = {u["user_id"]: u for u in users}

    def base(uid: int) -> dict[str, Any]:
        u = by_id[uid]
        return {"user_id": uid, "email": u["email"], "first_name": u["first_name"]}

    out: dict[int, dict[str, Any]] = {}
    if name == "finish_assessment":
        latest: dict[int, dict[str, Any]] = {}
        for a in assessments:
            if _in(a["started_at"], start, end) and (a["finished_at"] is None or a["finished_at"] >= end):
                cur = latest.get(a["user_id"])
                if cur is None or (a["started_at"], a["assessment_id"]) > (
                    cur["started_at"],
                    cur["assessment_id"],
                ):
                    latest[a["user_id"]] = a
        for uid, a in latest.items():
            out[uid] = {**base(uid), "assessment_id": a["assessment_id"], "assessment_kind": a["kind"]}
    elif name == "first_practice":
        started_before_end = {a["user_id"] for a in assessments if a["started_at"] < end}
        for u in users:
            if _in(u["signed_up_at"], start, end) and u["user_id"] not in started_before_end:
                out[u["user_id"]] = base(u["user_id"])
    elif name == "upgrade_offer":
        for a in assessments:
            if a["is_free"] and _in(a["finished_at"], start, end) and by_id[a["user_id"]]["plan"] == "free":
                row = out.setdefault(
                    a["user_id"], {**base(a["user_id"]), "free_tests_finished": 0, "best_score": None}
                )
                row["free_tests_finished"] += 1
                if a["score"] is not None and (row["best_score"] is None or a["score"] > row["best_score"]):
                    row["best_score"] = a["score"]
    elif name == "practice_tips":
        latest = {}
        for a in assessments:
            if _in(a["started_at"], start, end):
                cur = latest.get(a["user_id"])
                if cur is None or (a["started_at"], a["assessment_id"]) > (
                    cur["started_at"],
                    cur["assessment_id"],
                ):
                    latest[a["user_id"]] = a
        for u in users:
            uid = u["user_id"]
            if _in(u["last_active_at"], start, end) or uid in latest:
                out[uid] = {**base(uid), "recent_kind": latest[uid]["kind"] if uid in latest else None}
    else:  # pragma: no cover
        raise AssertionError(name)
    return out


def _windows(name: str) -> list[tuple[datetime, datetime]]:
    """The live window ending at the anchor, plus a historical one (exercises the 'after the window' rules)."""
    width = WINDOWS[name]
    return [(ANCHOR - width, ANCHOR), (ANCHOR - timedelta(days=5), ANCHOR - timedelta(days=3))]


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_audience_sql_is_static(name: str) -> None:
    sql = _audience_sql(name)
    code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines()).lower()
    assert "%(window_start)s" in code and "%(window_end)s" in code
    assert not re.search(r"\bnow\(\)|current_date|current_timestamp|localtimestamp|clock_timestamp", code)
    assert not code.rstrip().endswith(";")


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_audience_matches_python(
    name: str,
    conn: psycopg.Connection[Any],
    tables: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    users, assessments = tables
    for start, end in _windows(name):
        params = {"window_start": start, "window_end": end}
        cur = conn.execute(_audience_sql(name), params)
        rows = cur.fetchall()
        assert cur.description is not None
        columns = [d.name for d in cur.description]
        assert columns == ["user_id", "email", "first_name", *EXTRA_COLUMNS[name]]
        ids = [r["user_id"] for r in rows]
        assert len(ids) == len(set(ids)), "user_id must be unique per row"

        expected = expected_audience(name, users, assessments, start, end)
        assert set(ids) == set(expected), f"{name} [{start}, {end})"
        assert {r["user_id"]: r for r in rows} == expected  # extra columns too
        if end == ANCHOR:
            assert rows, f"{name} is empty for the default data"


def test_audience_sizes_at_lifecycle_windows(conn: psycopg.Connection[Any]) -> None:
    sizes = {}
    everyone: set[int] = set()
    for name in CAMPAIGNS:
        params = {"window_start": ANCHOR - WINDOWS[name], "window_end": ANCHOR}
        ids = {r["user_id"] for r in conn.execute(_audience_sql(name), params).fetchall()}
        sizes[name] = len(ids)
        everyone |= ids
    # Deterministic for seed 42 / 5,000 users / this anchor (Faker pinned in requirements-dev.txt).
    assert sizes == {"finish_assessment": 301, "first_practice": 293, "upgrade_offer": 2992, "practice_tips": 3493}
    assert len(everyone) == 4162


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_audience_works_inside_the_engine_wrapper(name: str, conn: psycopg.Connection[Any]) -> None:
    """The engine wraps the file as a subquery with keyset pagination; pages must tile the audience."""
    wrapped = (
        f"select * from ({_audience_sql(name)}) a where a.user_id > %(after)s order by a.user_id limit 100"
    )
    params: dict[str, Any] = {"window_start": ANCHOR - WINDOWS[name], "window_end": ANCHOR, "after": 0}
    seen: list[int] = []
    while True:
        page = conn.execute(wrapped, params).fetchall()
        if not page:
            break
        seen.extend(r["user_id"] for r in page)
        params["after"] = page[-1]["user_id"]
    full = conn.execute(_audience_sql(name), params).fetchall()
    assert seen == sorted(r["user_id"] for r in full)


# --------------------------------------------------------------------------- templates


def _autoescape(template_name: str | None) -> bool:
    return template_name is not None and ".html" in template_name


@pytest.fixture(scope="module")
def env() -> jinja2.Environment:
    return template_env(TEMPLATES)  # what the senders render with: the sandbox


SAMPLE_EXTRA: dict[str, dict[str, Any]] = {
    "finish_assessment": {"assessment_id": 1234, "assessment_kind": "situational_judgement"},
    "first_practice": {},
    "upgrade_offer": {"free_tests_finished": 2, "best_score": 74},
    "practice_tips": {"recent_kind": "numerical"},
}
UNSUBSCRIBE_URL = "https://mail.example.com/u/MTIzNA.c2lnbmF0dXJl-x_y"
APP_URL = "https://app.example.com"


def _ctx(name: str, first_name: str | None = "Ada", **extra: Any) -> dict[str, Any]:
    user = {
        "user_id": 1234,
        "email": "ada@example.com",
        "first_name": first_name,
        **SAMPLE_EXTRA[name],
        **extra,
    }
    return {"user": user, "campaign": name, "unsubscribe_url": UNSUBSCRIBE_URL, "app_url": APP_URL}


def _render(env: jinja2.Environment, name: str, ctx: dict[str, Any]) -> tuple[str, str]:
    return (
        env.get_template(f"{name}.html.j2").render(ctx),
        env.get_template(f"{name}.txt.j2").render(ctx),
    )


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_template_renders_unsubscribe_reason_and_cta(env: jinja2.Environment, name: str) -> None:
    html, text = _render(env, name, _ctx(name))
    for body in (html, text):
        assert UNSUBSCRIBE_URL in body
        assert "Hi Ada," in body
        assert "You're receiving this because" in body or "You&#39;re receiving this because" in body
        assert f"{APP_URL}/" in body  # call to action into the app
        assert "{{" not in body and "{%" not in body
    assert f'href="{UNSUBSCRIBE_URL}"' in html
    assert f"Unsubscribe: {UNSUBSCRIBE_URL}" in text
    assert "<img" not in html.lower()  # no tracking pixels
    assert html.endswith("</html>\n") and text.endswith("\n")


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_template_autoescapes_html_only(env: jinja2.Environment, name: str) -> None:
    html, text = _render(env, name, _ctx(name, first_name="<b>x</b>"))
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html
    assert "Hi <b>x</b>," in text and "&lt;" not in text


@pytest.mark.parametrize("name", CAMPAIGNS)
@pytest.mark.parametrize("first_name", [None, "", "   "])
def test_template_greeting_falls_back_to_there(
    env: jinja2.Environment, name: str, first_name: str | None
) -> None:
    html, text = _render(env, name, _ctx(name, first_name=first_name))
    assert "Hi there," in html and "Hi there," in text


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_template_renders_are_byte_identical(env: jinja2.Environment, name: str) -> None:
    first = _render(env, name, _ctx(name))
    env2 = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=_autoescape,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    assert _render(env, name, _ctx(name)) == first
    assert _render(env2, name, _ctx(name)) == first


def test_template_variants(env: jinja2.Environment) -> None:
    html, text = _render(env, "upgrade_offer", _ctx("upgrade_offer", free_tests_finished=1, best_score=None))
    assert "finishing a free practice test." in text and "best score" not in text
    html, text = _render(env, "practice_tips", _ctx("practice_tips", recent_kind=None))
    assert "practising" in text and "tests lately" not in text
    html, text = _render(env, "finish_assessment", _ctx("finish_assessment", assessment_kind="abstract"))
    assert "an abstract assessment" in text and f"{APP_URL}/assessments/1234" in html


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_template_missing_column_is_an_error(env: jinja2.Environment, name: str) -> None:
    ctx = _ctx(name)
    del ctx["unsubscribe_url"]
    with pytest.raises(jinja2.UndefinedError):
        _render(env, name, ctx)


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_templates_render_real_audience_rows(
    env: jinja2.Environment, name: str, conn: psycopg.Connection[Any]
) -> None:
    """Every column a template uses is one the audience returns (StrictUndefined would raise)."""
    params = {"window_start": ANCHOR - WINDOWS[name], "window_end": ANCHOR}
    rows = conn.execute(_audience_sql(name), params).fetchall()
    for row in rows[:200]:
        ctx = {
            "user": dict(row),
            "campaign": name,
            "unsubscribe_url": UNSUBSCRIBE_URL,
            "app_url": APP_URL + "/",
        }
        html, text = _render(env, name, ctx)
        assert UNSUBSCRIBE_URL in html and UNSUBSCRIBE_URL in text
        assert "None" not in text
