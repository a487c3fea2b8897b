"""Synthetic app data for the demo: users (Faker names per locale, a share of malformed and odd
but valid addresses) and their assessment activity, deterministic for a seed and an anchor."""

from __future__ import annotations

import random
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from faker import Faker

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
