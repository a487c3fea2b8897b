"""Deterministic demo data for the practice platform's ``app`` schema.

:func:`load_demo_data` creates the ``app`` schema (see ``app_schema.sql``) if
needed and fills ``app.users`` and ``app.assessments`` with a realistic,
seeded population: users sign up over the 14 days before ``anchor`` (the "now"
of the data), most start an assessment soon after, some abandon it, some finish
free tests, about 8% pay for the pro plan and a good share go quiet.

Every random choice comes from :class:`random.Random` streams seeded from
``seed`` (and Faker instances seeded the same way), so the same ``seed`` and
``anchor`` always produce identical rows (for a given Faker version).  Rows are
written with ``COPY``: 5,000 users load in a fraction of a second.

About 1% of the addresses are malformed in ways a real email API rejects
(see :data:`MALFORMED_KINDS`); a few percent more are odd but valid (plus tags,
subdomains, upper case) and must be accepted.  All domains are the reserved
``example.com`` / ``example.org`` / ``example.net`` (RFC 2606) and their
subdomains, so no demo address can reach a real mailbox.
"""

from __future__ import annotations

import random
import time
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any

import psycopg
from faker import Faker

__all__ = [
    "ASSESSMENT_KINDS",
    "LOCALES",
    "MALFORMED_KINDS",
    "LoadSummary",
    "load_demo_data",
    "schema_sql",
]

#: Faker locales used for names, with their share of users and the IANA time
#: zones their users live in.
LOCALES: dict[str, tuple[float, tuple[str, ...]]] = {
    "en_US": (0.40, ("America/New_York", "America/Chicago", "America/Denver", "America/Los_Angeles")),
    "en_GB": (0.25, ("Europe/London",)),
    "de_DE": (0.20, ("Europe/Berlin",)),
    "fr_FR": (0.15, ("Europe/Paris",)),
}

#: Assessment kinds and their relative popularity.
ASSESSMENT_KINDS: dict[str, int] = {
    "numerical": 30,
    "verbal": 25,
    "logical": 20,
    "diagrammatic": 10,
    "situational_judgement": 10,
    "mechanical": 5,
}

#: The kinds of malformed address the loader produces (~1% of users).  Each is
#: rejected by a real email API / ``email_validator.validate_email``.
MALFORMED_KINDS: tuple[str, ...] = (
    "double_at",  # anna@@example.com
    "space",  # anna mueller@example.com
    "no_domain_dot",  # anna.mueller@localhost
    "trailing_dot",  # anna.mueller@example.com.
    "double_dot_local",  # anna..mueller@example.com
    "comma",  # anna,mueller@example.com
)

MALFORMED_RATE = 0.01
ODD_VALID_RATE = 0.04
SIGNUP_SPREAD = timedelta(days=14)

_DOMAINS = ("example.com", "example.org", "example.net")
_ODD_DOMAINS = ("mail.example.com", "eu.example.org", "students.uni.example.net")

_USER_COLUMNS = (
    "user_id",
    "email",
    "first_name",
    "last_name",
    "signed_up_at",
    "timezone",
    "plan",
    "last_active_at",
)
_ASSESSMENT_COLUMNS = (
    "assessment_id",
    "user_id",
    "kind",
    "is_free",
    "started_at",
    "finished_at",
    "score",
)


@dataclass(frozen=True)
class LoadSummary:
    """What :func:`load_demo_data` did.

    Attributes:
        loaded: True if rows were written, False if the tables already had data
            and the call did nothing (see ``message``).
        users: rows in ``app.users`` after the call (written or pre-existing).
        assessments: rows in ``app.assessments`` after the call.
        pro_users: users on the ``pro`` plan after the call.
        malformed_emails: malformed addresses written by this call (0 when
            nothing was loaded: pre-existing data is not inspected).
        odd_valid_emails: odd-but-valid addresses written by this call.
        seed: the seed used (as passed).
        anchor: the data's "now", an aware UTC datetime; every generated
            timestamp is strictly before it.
        reset: True if the tables were truncated first.
        elapsed_s: wall-clock seconds spent in the call.
        message: one human-readable line.
    """

    loaded: bool
    users: int
    assessments: int
    pro_users: int
    malformed_emails: int
    odd_valid_emails: int
    seed: int
    anchor: datetime
    reset: bool
    elapsed_s: float
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class _User:
    user_id: int
    email: str
    first_name: str | None
    last_name: str | None
    signed_up_at: datetime
    timezone: str
    plan: str
    last_active_at: datetime | None
    email_kind: str  # "normal" | "odd_valid" | one of MALFORMED_KINDS


def schema_sql() -> str:
    """Return the text of ``app_schema.sql`` (idempotent DDL for schema ``app``)."""
    return resources.files("mailflow_dev.demo").joinpath("app_schema.sql").read_text(encoding="utf-8")


def load_demo_data(
    conn: psycopg.Connection[Any],
    *,
    users: int = 5000,
    seed: int = 42,
    anchor: datetime,
    reset: bool = False,
) -> LoadSummary:
    """Create schema ``app`` if needed and load a deterministic demo population.

    Args:
        conn: an open psycopg 3 connection (autocommit or not).  All work runs
            in ``conn.transaction()``: with no transaction open it is committed
            at the end; inside a caller's transaction it becomes a savepoint and
            the caller commits.
        users: number of users to create (>= 1); user_ids are ``1..users`` in
            sign-up order.
        seed: seed of every random stream; same ``seed`` + ``anchor`` (+ same
            Faker version) -> identical rows.
        anchor: aware datetime, the "now" of the data (converted to UTC).
            Users sign up in ``[anchor - 14 days, anchor)``; all timestamps are
            whole seconds and strictly before ``anchor``.
        reset: truncate ``app.assessments`` and ``app.users`` first.  Without
            it, if ``app.users`` already has rows the call changes nothing and
            returns a summary with ``loaded=False``.

    Returns:
        A :class:`LoadSummary`.

    Raises:
        ValueError: ``anchor`` is naive or ``users`` < 1.
        psycopg.Error: database errors (the transaction is rolled back).
    """
    if anchor.tzinfo is None or anchor.utcoffset() is None:
        raise ValueError("anchor must be an aware datetime (UTC recommended)")
    if users < 1:
        raise ValueError("users must be >= 1")
    anchor = anchor.astimezone(UTC)
    started = time.perf_counter()

    with conn.transaction(), conn.cursor() as cur:
        # Serialise concurrent loaders on the same database (DDL included).
        cur.execute("select pg_advisory_xact_lock(hashtext('mailflow.demo.load_demo_data'))")
        cur.execute(schema_sql())  # trusted static DDL from the package
        if reset:
            cur.execute("truncate app.assessments, app.users")
        else:
            cur.execute("select exists (select 1 from app.users)")
            row = cur.fetchone()
            if row is not None and row[0]:
                n_users, n_assessments, n_pro = _counts(cur)
                return LoadSummary(
                    loaded=False,
                    users=n_users,
                    assessments=n_assessments,
                    pro_users=n_pro,
                    malformed_emails=0,
                    odd_valid_emails=0,
                    seed=seed,
                    anchor=anchor,
                    reset=False,
                    elapsed_s=time.perf_counter() - started,
                    message=(
                        f"app.users already has {n_users} rows: nothing loaded "
                        f"(pass reset=True, or --reset to make demo / python -m mailflow_dev.demo, to reload)"
                    ),
                )

        user_rows, assessment_rows = generate(users=users, seed=seed, anchor=anchor)

        # Binary COPY: no text formatting/parsing of timestamps on either side.
        with cur.copy(f"copy app.users ({', '.join(_USER_COLUMNS)}) from stdin (format binary)") as copy:
            copy.set_types(["int8", "text", "text", "text", "timestamptz", "text", "text", "timestamptz"])
            for u in user_rows:
                copy.write_row(
                    (
                        u.user_id,
                        u.email,
                        u.first_name,
                        u.last_name,
                        u.signed_up_at,
                        u.timezone,
                        u.plan,
                        u.last_active_at,
                    )
                )
        with cur.copy(
            f"copy app.assessments ({', '.join(_ASSESSMENT_COLUMNS)}) from stdin (format binary)"
        ) as copy:
            copy.set_types(["int8", "int8", "text", "bool", "timestamptz", "timestamptz", "int4"])
            for a in assessment_rows:
                copy.write_row(a)
        cur.execute("analyze app.users")
        cur.execute("analyze app.assessments")

    malformed = sum(1 for u in user_rows if u.email_kind in MALFORMED_KINDS)
    odd = sum(1 for u in user_rows if u.email_kind == "odd_valid")
    pro = sum(1 for u in user_rows if u.plan == "pro")
    elapsed = time.perf_counter() - started
    return LoadSummary(
        loaded=True,
        users=len(user_rows),
        assessments=len(assessment_rows),
        pro_users=pro,
        malformed_emails=malformed,
        odd_valid_emails=odd,
        seed=seed,
        anchor=anchor,
        reset=reset,
        elapsed_s=elapsed,
        message=(
            f"loaded {len(user_rows)} users ({pro} pro, {malformed} malformed and {odd} odd-but-valid "
            f"addresses) and {len(assessment_rows)} assessments; seed={seed}, "
            f"anchor={anchor.isoformat()}{', after reset' if reset else ''}, in {elapsed:.2f}s"
        ),
    )


def _counts(cur: psycopg.Cursor[Any]) -> tuple[int, int, int]:
    cur.execute(
        "select (select count(*) from app.users),"
        " (select count(*) from app.assessments),"
        " (select count(*) from app.users where plan = 'pro')"
    )
    row = cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


# --------------------------------------------------------------------------- generation

_AssessmentRow = tuple[int, int, str, bool, datetime, datetime | None, int | None]


def _name_table(names: Any) -> tuple[list[str], list[float] | None]:
    """Faker name data (weighted OrderedDict or plain sequence) -> (names, cum_weights)."""
    if isinstance(names, dict):
        items = list(names.items())
        cum, total = [], 0.0
        for _, w in items:
            total += float(w)
            cum.append(total)
        return [n for n, _ in items], cum
    return list(names), None


def _faker_names(
    locale: str,
) -> tuple[tuple[list[str], list[float] | None], tuple[list[str], list[float] | None]]:
    """First- and last-name tables of a Faker locale's person provider."""
    fk = Faker(locale)
    for provider in fk.factories[0].providers:
        if hasattr(provider, "first_names") and hasattr(provider, "last_names"):
            return _name_table(provider.first_names), _name_table(provider.last_names)
    raise RuntimeError(f"Faker locale {locale} has no person provider")  # pragma: no cover


def _pick(rng: random.Random, table: tuple[list[str], list[float] | None]) -> str:
    names, cum = table
    if cum is None:
        return names[int(rng.random() * len(names))]
    return rng.choices(names, cum_weights=cum)[0]


def generate(*, users: int, seed: int, anchor: datetime) -> tuple[list[_User], list[_AssessmentRow]]:
    """Generate the rows without touching a database (pure, deterministic).

    Names come from Faker's per-locale name lists (with Faker's weights),
    sampled by a :class:`random.Random` seeded from ``seed``.

    Returns ``(users, assessments)``: user records in user_id order and
    assessment tuples in ``app.assessments`` column order, sorted by
    assessment_id (which follows ``started_at``).  ``anchor`` must be aware.
    """
    anchor = anchor.astimezone(UTC)
    # Separate streams, so e.g. tuning the activity model leaves names and
    # addresses (and the malformed count) unchanged.
    rng_people = random.Random(f"mailflow-demo:{seed}:people")
    rng_email = random.Random(f"mailflow-demo:{seed}:email")
    rng_act = random.Random(f"mailflow-demo:{seed}:activity")

    tables = {loc: _faker_names(loc) for loc in LOCALES}
    locale_names = list(LOCALES)
    locale_cum: list[float] = []
    acc = 0.0
    for loc in locale_names:
        acc += LOCALES[loc][0]
        locale_cum.append(acc)

    base = anchor.replace(microsecond=0)
    spread_s = int(SIGNUP_SPREAD.total_seconds())
    # Whole-second offsets before anchor, oldest first, so user_id follows sign-up order.
    offsets = sorted((rng_act.randint(1, spread_s) for _ in range(users)), reverse=True)

    kinds = list(ASSESSMENT_KINDS)
    kind_cum: list[float] = []
    acc = 0.0
    for k in kinds:
        acc += ASSESSMENT_KINDS[k]
        kind_cum.append(acc)

    _cache: dict[int, datetime] = {}

    def ts(sec: int) -> datetime:
        """Seconds relative to anchor (negative) -> aware UTC datetime."""
        value = _cache.get(sec)
        if value is None:
            value = _cache[sec] = base + timedelta(seconds=sec)
        return value

    taken: set[str] = set()
    user_rows: list[_User] = []
    raw: list[tuple[int, int, str, bool, int | None, int | None]] = []

    for idx in range(users):
        user_id = idx + 1
        loc = rng_people.choices(locale_names, cum_weights=locale_cum)[0]
        first_table, last_table = tables[loc]
        first: str | None = _pick(rng_people, first_table)
        last: str | None = _pick(rng_people, last_table)
        tz_choices = LOCALES[loc][1]
        tz = tz_choices[int(rng_people.random() * len(tz_choices))]
        r = rng_people.random()
        if r < 0.02:
            first = None
        elif r < 0.03:
            first = ""
        elif r < 0.035:
            first = f" {first} "  # stray whitespace, as typed
        email, email_kind = _email(rng_email, first or "", last or "", taken)

        signed_up = -offsets[idx]
        plan, last_active, items = _activity(rng_act, signed_up, kinds, kind_cum)
        for started_at, kind, is_free, finished_at, score in items:
            raw.append((started_at, user_id, kind, is_free, finished_at, score))
        user_rows.append(
            _User(
                user_id,
                email,
                first,
                last,
                ts(signed_up),
                tz,
                plan,
                None if last_active is None else ts(last_active),
                email_kind,
            )
        )

    raw.sort(key=lambda a: (a[0], a[1]))
    assessment_rows: list[_AssessmentRow] = [
        (i + 1, uid, kind, is_free, ts(started), None if finished is None else ts(finished), score)
        for i, (started, uid, kind, is_free, finished, score) in enumerate(raw)
    ]
    return user_rows, assessment_rows


_TRANSLIT = str.maketrans(
    {"ß": "ss", "æ": "ae", "Æ": "Ae", "œ": "oe", "Œ": "Oe", "ø": "o", "Ø": "O", "ł": "l"}
)


def _slug(text: str) -> str:
    """Lower-case ASCII letters and digits of ``text`` (accents folded, ß -> ss)."""
    ascii_text = (
        unicodedata.normalize("NFKD", text.translate(_TRANSLIT)).encode("ascii", "ignore").decode("ascii")
    )
    return "".join(ch for ch in ascii_text.lower() if ch.isalnum())


def _email(rng: random.Random, first: str, last: str, taken: set[str]) -> tuple[str, str]:
    """One unique address for a user, and its kind (normal, odd_valid or malformed)."""
    f, la = _slug(first), _slug(last)
    pattern = rng.random()
    if f and la:
        local = f"{f}.{la}" if pattern < 0.6 else f"{f[0]}{la}" if pattern < 0.8 else f"{f}_{la}"
    else:
        local = f or la or "user"
    domain = rng.choices(_DOMAINS, (5, 3, 2))[0]
    # Local parts are unique across all domains (on a clash append the smallest
    # free number, deterministically), so every variant below is unique too.
    candidate, n = local, 1
    while candidate in taken:
        n += 1
        candidate = f"{local}{n}"
    local = candidate
    taken.add(local)

    r = rng.random()
    if r < MALFORMED_RATE:
        kind = rng.choice(MALFORMED_KINDS)
        if "." in local:
            head, tail = local.split(".", 1)
        else:
            cut = max(1, len(local) // 2)
            head, tail = local[:cut], local[cut:] or "x"
        if kind == "double_at":
            address = f"{local}@@{domain}"
        elif kind == "space":
            address = f"{head} {tail}@{domain}"
        elif kind == "no_domain_dot":
            address = f"{local}@localhost"
        elif kind == "trailing_dot":
            address = f"{local}@{domain}."
        elif kind == "double_dot_local":
            address = f"{head}..{tail}@{domain}"
        else:  # comma
            address = f"{head},{tail}@{domain}"
        return address, kind
    if r < MALFORMED_RATE + ODD_VALID_RATE:
        variant = rng.randrange(3)
        if variant == 0:
            address = f"{local}+{rng.choice(('practice', 'jobs', 'aptitude', 'uni'))}@{domain}"
        elif variant == 1:
            address = f"{local}@{rng.choice(_ODD_DOMAINS)}"
        else:
            name, tld = domain.split(".")
            address = f"{local.title()}@{name.title()}.{tld.upper()}"
        return address, "odd_valid"
    return f"{local}@{domain}", "normal"


_HOUR = 3600
_DAY = 86400


def _activity(
    rng: random.Random,
    signed_up: int,
    kinds: list[str],
    kind_cum: list[float],
) -> tuple[str, int | None, list[tuple[int, str, bool, int | None, int | None]]]:
    """Simulate one user's life from sign-up to "now".

    All times are whole seconds relative to the anchor (negative = before it);
    every returned time is <= -1, i.e. strictly before the anchor.  Returns
    ``(plan, last_active_at, assessments)`` with assessments as
    ``(started_at, kind, is_free, finished_at, score)``.
    """
    limit = -1  # latest allowed timestamp
    rand = rng.random
    items: list[tuple[int, str, bool, int | None, int | None]] = []

    # Sign-up session: looked around for a few minutes.
    last_active: int | None = min(limit, signed_up + 30 + int(rand() * 870))

    if rand() < 0.22:  # never starts an assessment
        if rand() < 0.4:
            last_active = None  # never came back after the sign-up form
        elif rand() < 0.3:  # came back once to browse
            t = signed_up + int((2 + rand() * 94) * _HOUR)
            if t <= limit:
                last_active = t
        return "free", last_active, items

    # Delay before the first assessment.
    r = rand()
    if r < 0.45:
        delay = int(rng.expovariate(1 / 900))  # ~15 minutes
    elif r < 0.8:
        delay = int((1 + rand() * 23) * _HOUR)
    else:
        delay = int((1 + rand() * 4) * _DAY)
    t = signed_up + delay

    # Engagement: some try one test and never come back, quiet users stop within
    # ~2 days, the rest keep practising every few days.
    r = rand()
    if r < 0.12:
        stop_at = t
    elif r < 0.45:
        stop_at = t + int(rand() * 48 * _HOUR)
    else:
        stop_at = t + 30 * _DAY
    gap = (1.0 + rand() * 3.0) * _DAY  # typical time between sessions, seconds
    # How often this user finishes what they start: most nearly always, some often quit.
    finish_skill = 0.94 + rand() * 0.05 if rand() < 0.85 else 0.4 + rand() * 0.35
    ability = rng.gauss(62, 12)
    will_pay = rand() < 0.2  # considers paying once they finished a free test
    pro = False
    finished_free = False

    while t <= limit and t <= stop_at:
        n_tests = 1 if (r := rand()) < 0.7 else 2 if r < 0.95 else 3
        for _ in range(n_tests):
            if t > limit:
                break
            if not pro and will_pay and finished_free and rand() < 0.5:
                pro = True  # pays now, before this test
            is_free = not pro or rand() < 0.35
            kind = rng.choices(kinds, cum_weights=kind_cum)[0]
            p_finish = finish_skill * (0.85 if not items else 1.0)
            if rand() < p_finish:
                end = t + 480 + int(rand() * 2220)  # 8..45 minutes
                if end <= limit:
                    score = max(5, min(100, round(rng.gauss(ability, 10))))
                    items.append((t, kind, is_free, end, score))
                    finished_free = finished_free or is_free
                    last_active = end if last_active is None else max(last_active, end)
                else:  # still in progress at "now"
                    items.append((t, kind, is_free, None, None))
                    last_active = t if last_active is None else max(last_active, t)
                t = end + 60 + int(rand() * 840)
            else:  # abandoned after a few minutes
                quit_at = min(limit, t + 60 + int(rand() * 1140))
                items.append((t, kind, is_free, None, None))
                last_active = quit_at if last_active is None else max(last_active, quit_at)
                t = quit_at + 60 + int(rand() * 840)
        t += int(rng.expovariate(1 / gap))

    # Some active users also browse (tips, results) without starting a test.
    if last_active is not None and rand() < 0.3:
        browse = last_active + int((1 + rand() * 71) * _HOUR)
        if browse <= limit:
            last_active = browse
    return ("pro" if pro else "free"), last_active, items
