"""Unsubscribe tokens: the v1/v2 formats, verification, rotation, expiry, a seeded fuzz of mutated
tokens (none accepted unless it is a documented canonical re-spelling), and the List-Unsubscribe
headers the renderer derives from them."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import random
import string
from collections import Counter
from collections.abc import Callable
from datetime import date, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mailflow.campaigns import Campaign, load_campaigns
from mailflow.feedback.unsubscribe_tokens import (
    ExpiredToken,
    InvalidToken,
    UnsubscribeSigner,
    canonical_token,
    day_number,
    signer_from_connection,
    signer_from_secret,
)
from mailflow.model.outcome import MintedRow
from mailflow.sendloop.render import Renderer

SECRET = "test-secret-0123456789abcdef"
OTHER = "another-secret-0123456789abcdef"
TODAY = date(2026, 11, 30)
B32 = "abcdefghijklmnopqrstuvwxyz234567"


def _b32(mac: bytes) -> str:
    return base64.b32encode(mac[:16]).decode().rstrip("=").lower()


# -- formats ----------------------------------------------------------------------------------------

def test_v1_format_is_unchanged_so_links_already_in_inboxes_keep_working() -> None:
    expected_sig = _b32(hmac.new(SECRET.encode(), b"k1.42.finish_assessment", hashlib.sha256).digest())
    token = signer_from_secret(SECRET).token(42, "finish_assessment")
    assert token == f"k1.42.finish_assessment.{expected_sig}"
    assert signer_from_secret(SECRET).verify(token) == (42, "finish_assessment")


def test_v2_token_carries_the_issue_day_and_a_domain_separated_signature() -> None:
    s = signer_from_secret(SECRET)
    token = s.token(42, "all", issued=TODAY)
    kid, uid, list_id, day, sig = token.split(".")
    assert (kid, uid, list_id, day) == ("k1", "42", "all", str(day_number(TODAY)))
    assert day_number(TODAY) == (TODAY - date(1970, 1, 1)).days == 20787
    assert sig == _b32(hmac.new(SECRET.encode(), f"mailflow-unsubscribe-v2|k1.42.all.{day}".encode(),
                                hashlib.sha256).digest())
    assert set(token) <= set(string.ascii_lowercase + string.digits + "._-")
    assert s.verify(token, today=TODAY) == (42, "all")
    assert s.token(42, "all", issued=TODAY) == token  # deterministic: the day is an input


def test_v2_fields_are_bound_by_the_signature() -> None:
    s = signer_from_secret(SECRET)
    kid, uid, list_id, day, sig = s.token(42, "all", issued=TODAY).split(".")
    with pytest.raises(InvalidToken, match="bad signature"):  # the day dropped: not a v1 signature
        s.verify(f"{kid}.{uid}.{list_id}.{sig}", today=TODAY)
    with pytest.raises(InvalidToken, match="bad signature"):  # a later day to dodge the expiry
        s.verify(f"{kid}.{uid}.{list_id}.{int(day) + 1}.{sig}", today=TODAY)
    with pytest.raises(InvalidToken, match="bad signature"):  # a v1 signature with a day added
        v1_sig = s.token(42, "all").split(".")[3]
        s.verify(f"{kid}.{uid}.{list_id}.{day}.{v1_sig}", today=TODAY)


@pytest.mark.parametrize("mangle", [
    lambda t: t.replace(".42.", ".042."),  # leading zero in the user id
    lambda t: t.replace(f".{day_number(TODAY)}.", f".0{day_number(TODAY)}."),  # leading zero in the day
    lambda t: t.replace(".42.", ".+42."),
    lambda t: t.replace(".42.", ". 42."),
    lambda t: t.replace(".42.", ".4_2."),
])
def test_numbers_have_one_spelling(mangle: Callable[[str], str]) -> None:
    s = signer_from_secret(SECRET)
    token = s.token(42, "all", issued=TODAY)
    assert mangle(token) != token
    with pytest.raises(InvalidToken):
        s.verify(mangle(token), today=TODAY)


def test_token_arguments_are_validated() -> None:
    s = signer_from_secret(SECRET)
    with pytest.raises(ValueError, match="user id"):
        s.token(-1, "all")
    with pytest.raises(ValueError, match="user id"):
        s.token(10**18, "all")
    with pytest.raises(ValueError, match="issue date"):
        s.token(1, "all", issued=date(1969, 12, 31))
    assert s.verify(s.token(10**18 - 1, "a" * 64)) == (10**18 - 1, "a" * 64)


# -- expiry -----------------------------------------------------------------------------------------

def test_v2_tokens_expire_after_max_age_days_and_v1_tokens_never_do() -> None:
    s = signer_from_secret(SECRET, max_age_days=60)
    fresh = s.token(7, "practice_tips", issued=TODAY - timedelta(days=60))
    stale = s.token(7, "practice_tips", issued=TODAY - timedelta(days=61))
    assert s.verify(fresh, today=TODAY) == (7, "practice_tips")
    with pytest.raises(ExpiredToken, match="61 days ago"):
        s.verify(stale, today=TODAY)
    assert issubclass(ExpiredToken, InvalidToken)
    assert s.verify(s.token(7, "practice_tips"), today=TODAY + timedelta(days=10_000)) == (7, "practice_tips")
    # without a maximum age a dated token is valid at any age
    assert signer_from_secret(SECRET).verify(stale, today=TODAY + timedelta(days=3650)) == (7, "practice_tips")


def test_a_token_from_the_future_is_refused_beyond_one_day_of_skew() -> None:
    s = signer_from_secret(SECRET, max_age_days=60)
    assert s.verify(s.token(1, "all", issued=TODAY + timedelta(days=1)), today=TODAY) == (1, "all")
    with pytest.raises(InvalidToken, match="future"):
        s.verify(s.token(1, "all", issued=TODAY + timedelta(days=2)), today=TODAY)


def test_max_age_must_leave_links_working_for_30_days() -> None:
    with pytest.raises(ValueError, match="at least 30"):
        signer_from_secret(SECRET, max_age_days=29)
    assert signer_from_secret(SECRET, max_age_days=30).max_age_days == 30


# -- rotation ---------------------------------------------------------------------------------------

def test_rotation_sign_with_the_new_key_verify_both_then_retire_the_old_one() -> None:
    before = signer_from_secret(SECRET, kid="k1")
    old_v1, old_v2 = before.token(42, "all"), before.token(42, "all", issued=TODAY)
    during = signer_from_connection("rotated-secret-abcdefghijklmnop", {"kid": "k2", "old_keys": {"k1": SECRET}})
    assert during.current_kid == "k2"
    new = during.token(42, "all", issued=TODAY)
    assert new.startswith("k2.42.all.")
    assert [during.verify(t, today=TODAY) for t in (old_v1, old_v2, new)] == [(42, "all")] * 3
    with pytest.raises(InvalidToken, match="unknown key"):
        before.verify(new, today=TODAY)
    # the old key id on a token signed with the new secret, and vice versa
    with pytest.raises(InvalidToken, match="bad signature"):
        during.verify("k1." + new.split(".", 1)[1], today=TODAY)
    with pytest.raises(InvalidToken, match="bad signature"):
        during.verify("k2." + old_v2.split(".", 1)[1], today=TODAY)
    after = signer_from_connection("rotated-secret-abcdefghijklmnop", {"kid": "k2"})  # k1 retired
    assert after.verify(new, today=TODAY) == (42, "all")
    for t in (old_v1, old_v2):
        with pytest.raises(InvalidToken, match="unknown key"):
            after.verify(t, today=TODAY)


def test_signer_from_connection_reads_kid_old_keys_and_max_age_and_never_echoes_secrets() -> None:
    s = signer_from_connection(SECRET, {"kid": "k3", "old_keys": {"k1": OTHER}, "max_age_days": "400"})
    assert (s.current_kid, sorted(s.keys), s.max_age_days) == ("k3", ["k1", "k3"], 400)
    assert signer_from_connection(SECRET, None).current_kid == "k1"
    with pytest.raises(ValueError, match="no password") as err:
        signer_from_connection("", {})
    with pytest.raises(ValueError, match="old_keys") as err:
        signer_from_connection(SECRET, {"old_keys": ["k1", OTHER]})
    with pytest.raises(ValueError) as err:
        signer_from_connection(SECRET, {"old_keys": {"k0": "short"}})
    assert "short" not in str(err.value).replace("shorter", "")
    assert SECRET not in str(err.value)


# -- canonical re-spellings and the fuzz ---------------------------------------------------------------

def test_canonical_token_is_the_documented_normalisation() -> None:
    assert canonical_token("  K1.42.ALL.ABC234).\r\n") == "k1.42.all.abc234"
    assert canonical_token("k1.42.all.abc'\",;:!?>]}") == "k1.42.all.abc"
    assert canonical_token("k1.42.all.abc-") == "k1.42.all.abc-"  # '-' is a token character, not stripped


FuzzCase = tuple[str, str]


def _mutations(rng: random.Random, token: str, foreign: list[str]) -> list[FuzzCase]:
    """Mutants of ``token``, each labelled with its operator."""
    alphabet = string.ascii_letters + string.digits + "._-~%+/=:;@ \t" + "\u00e9\u0130\u212a\uff11\u0663\u00b2"
    parts = token.split(".")
    sig = parts[-1]
    out: list[FuzzCase] = []
    i = rng.randrange(len(token))
    out.append(("flip", token[:i] + rng.choice([c for c in alphabet if c != token[i]]) + token[i + 1:]))
    b = bytearray(token.encode())
    j = rng.randrange(len(b))
    b[j] ^= 1 << rng.randrange(8)
    out.append(("bitflip", b.decode("latin-1")))
    out.append(("truncate", token[:rng.randrange(len(token))]))
    out.append(("truncate_sig", ".".join(parts[:-1] + [sig[:rng.randrange(len(sig))]])))
    k = rng.randrange(len(token) + 1)
    out.append(("insert", token[:k] + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) + token[k:]))
    d = rng.randrange(len(token))
    out.append(("delete", token[:d] + token[d + 1:]))
    out.append(("sig_case", ".".join(parts[:-1] + ["".join(c.upper() if rng.random() < 0.5 else c for c in sig)])))
    a, c = rng.sample(range(len(parts)), 2)
    swapped = list(parts)
    swapped[a], swapped[c] = swapped[c], swapped[a]
    out.append(("swap_fields", ".".join(swapped)))
    other = rng.choice(foreign)
    donor = other.split(".")
    mixed = list(parts)
    slot = rng.randrange(min(len(parts), len(donor)))
    mixed[slot] = donor[slot]
    out.append(("mix_foreign_field", ".".join(mixed)))
    out.append(("foreign_sig", ".".join(parts[:-1] + [donor[-1]])))
    out.append(("duplicate_field", ".".join(parts[:slot + 1] + [parts[slot]] + parts[slot + 1:])))
    out.append(("append", token + rng.choice([".", "-", "_", "0", "a", "=", "%20", ".x"]) * rng.randint(1, 2)))
    n = rng.randrange(len(token))
    out.append(("sig_char", ".".join(parts[:-1] + [sig[:n % len(sig)] + rng.choice(B32) + sig[n % len(sig) + 1:]])))
    return out


def test_fuzz_no_mutated_token_is_accepted_unless_it_is_a_canonical_respelling() -> None:
    rng = random.Random(20261130)
    signer = signer_from_secret(SECRET, kid="k2", old={"k1": OTHER}, max_age_days=400)
    foreign_signer = signer_from_secret("a-third-secret-not-in-the-ring!", kid="k2")
    originals: list[str] = []
    other_secret: list[str] = []  # same kid, same fields, a secret outside the ring
    donors: list[str] = []  # field and signature donors: other secret, or another user's valid token
    for uid in (0, 1, 7, 42, 5000, 123456789012345678):
        for list_id in ("all", "finish_assessment", "upgrade_offer"):
            for issued in (None, TODAY - timedelta(days=3)):
                originals.append(signer.token(uid, list_id, issued=issued))
                other_secret.append(foreign_signer.token(uid, list_id, issued=issued))
                donors += [other_secret[-1], signer.token(uid + 1, list_id, issued=issued)]
    # tokens of the old key in the ring too
    old = signer_from_secret(OTHER, kid="k1")
    originals += [old.token(9, "all"), old.token(9, "practice_tips", issued=TODAY)]

    accepted_equivalent: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    total = 0
    while total < 12_000:
        token = rng.choice(originals)
        claims = signer.verify(token, today=TODAY)
        for op, mutant in _mutations(rng, token, donors):
            if mutant == token:
                continue  # the operator happened to change nothing (e.g. a donor with the same kid)
            total += 1
            try:
                got = signer.verify(mutant, today=TODAY)
            except InvalidToken:  # any other exception type fails the test
                refused[op] += 1
                continue
            # accepted: only a documented re-spelling of this very token (case, trailing
            # punctuation or whitespace), with the same claims
            assert canonical_token(mutant) == token, f"{op}: accepted {mutant!r} (from {token!r})"
            assert got == claims
            accepted_equivalent[op] += 1
    for t in other_secret:
        with pytest.raises(InvalidToken, match="bad signature"):
            signer.verify(t, today=TODAY)
    assert total >= 10_000
    assert sum(refused.values()) >= 10_000
    assert accepted_equivalent["sig_case"] > 0  # upper-cased signatures are the same token
    for op in ("truncate", "truncate_sig", "delete", "swap_fields", "foreign_sig", "duplicate_field"):
        assert accepted_equivalent[op] == 0 and refused[op] > 500, op


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=160))
def test_arbitrary_text_is_refused_with_invalid_token_only(text: str) -> None:
    s = signer_from_secret(SECRET)
    with pytest.raises(InvalidToken):
        s.verify(text)


@settings(max_examples=200, deadline=None)
@given(uid=st.integers(min_value=0, max_value=10**18 - 1), list_id=st.from_regex(r"[a-z0-9_]{1,64}", fullmatch=True),
       day=st.one_of(st.none(), st.dates(min_value=date(1970, 1, 1), max_value=date(2100, 1, 1))))
def test_every_issued_token_round_trips_and_uses_the_safe_alphabet(uid: int, list_id: str, day: date | None) -> None:
    s = signer_from_secret(SECRET)
    token = s.token(uid, list_id, issued=day)
    assert set(token) <= set(string.ascii_lowercase + string.digits + "._-")
    assert canonical_token(token) == token
    assert s.verify(token, today=day or TODAY) == (uid, list_id)


# -- headers ------------------------------------------------------------------------------------------

PUBLIC = "https://mail.example.com"


@pytest.fixture(scope="module")
def campaign() -> Campaign:
    return {c.name: c for c in load_campaigns()}["first_practice"]


ROW = MintedRow(id=11, user_id=42, email="jane@example.com", context={"first_name": "Jane"})


def test_mailto_is_added_after_the_https_uri_when_configured(campaign: Campaign) -> None:
    r = Renderer(signer_from_secret(SECRET), PUBLIC, "https://app.example.com", mailto="unsubscribe@mail.example.com")
    email = r.render_email(campaign, ROW)
    token = r.signer.token(42, "first_practice")
    assert email["headers"]["List-Unsubscribe"] == (
        f"<{PUBLIC}/u/{token}>, <mailto:unsubscribe@mail.example.com?subject=unsubscribe%20{token}>")
    assert email["headers"]["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert f"{PUBLIC}/u/{token}" in email["html"] and f"{PUBLIC}/u/{token}" in email["text"]


def test_mailto_comes_from_the_environment_once_and_can_be_turned_off(campaign: Campaign,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILFLOW_UNSUBSCRIBE_MAILTO", "mailto:leave@mail.example.com")
    r = Renderer(signer_from_secret(SECRET), PUBLIC, "https://app.example.com")
    monkeypatch.setenv("MAILFLOW_UNSUBSCRIBE_MAILTO", "changed@mail.example.com")  # read at construction only
    assert "<mailto:leave@mail.example.com?subject=unsubscribe%20k1.42." in r.render_email(campaign, ROW)["headers"][
        "List-Unsubscribe"]
    off = Renderer(signer_from_secret(SECRET), PUBLIC, "https://app.example.com", mailto="")
    assert "mailto" not in off.render_email(campaign, ROW)["headers"]["List-Unsubscribe"]
    monkeypatch.delenv("MAILFLOW_UNSUBSCRIBE_MAILTO")
    assert "mailto" not in Renderer(signer_from_secret(SECRET), PUBLIC, "https://app.example.com").render_email(
        campaign, ROW)["headers"]["List-Unsubscribe"]


@pytest.mark.parametrize("bad", ["not-an-address", "a@b>, <https://evil.example", "x@example.com?subject=hi",
                                 "a b@example.com"])
def test_a_malformed_mailto_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="mailto"):
        Renderer(signer_from_secret(SECRET), PUBLIC, "https://app.example.com", mailto=bad)


def test_transactional_campaigns_carry_no_unsubscribe_headers_even_with_a_mailto(campaign: Campaign) -> None:
    r = Renderer(signer_from_secret(SECRET), PUBLIC, "https://app.example.com", mailto="u@mail.example.com")
    headers = r.render_email(dataclasses.replace(campaign, marketing=False), ROW)["headers"]
    assert headers == {"X-Mailflow-Send-Id": "11", "X-Mailflow-Campaign": "first_practice"}


def test_issued_on_gives_dated_tokens_and_byte_identical_batches(campaign: Campaign) -> None:
    def batch(day: date | None) -> bytes:
        r = Renderer(signer_from_secret(SECRET), PUBLIC, "https://app.example.com", mailto="", issued_on=day)
        return r.prepare_batch(campaign, [ROW]).body

    assert batch(TODAY) == batch(TODAY)
    assert batch(None) != batch(TODAY)
    [email] = json.loads(batch(TODAY))
    token = email["headers"]["List-Unsubscribe"][len(f"<{PUBLIC}/u/"):-1]
    assert token.split(".")[3] == str(day_number(TODAY))
    assert signer_from_secret(SECRET, max_age_days=30).verify(token, today=TODAY + timedelta(days=30)) == (
        42, "first_practice")


def test_signer_dataclass_rejects_bad_rings() -> None:
    with pytest.raises(ValueError, match="not in the key ring"):
        UnsubscribeSigner(keys={"k1": SECRET.encode()}, current_kid="k2")
