"""Rendering (deterministic batch bytes, headers, escaping), reconcile-by-index and unsubscribe tokens."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest

from mailflow.campaigns import Campaign, load_campaigns
from mailflow.feedback.unsubscribe_tokens import InvalidToken, UnsubscribeSigner, signer_from_secret
from mailflow.model.apply_by_index import reconcile_by_index
from mailflow.model.keys import idempotency_key
from mailflow.model.outcome import Accepted, MintedRow, Unknown
from mailflow.sendloop.render import Renderer

SECRET = "test-secret-0123456789abcdef"
PUBLIC = "https://mail.example.com"
APP = "https://app.example.com"


@pytest.fixture(scope="module")
def campaigns() -> dict[str, Campaign]:
    return {c.name: c for c in load_campaigns()}


def renderer() -> Renderer:
    return Renderer(signer_from_secret(SECRET), PUBLIC + "/", APP + "/")


def fa_rows(n: int = 3, first: int = 101) -> list[MintedRow]:
    return [MintedRow(id=first + i, user_id=5000 + i, email=f"user{i}@example.com",
                      context={"first_name": f"Name{i}", "assessment_id": 900 + i, "assessment_kind": "numerical"})
            for i in range(n)]


# -- rendering -----------------------------------------------------------------------------------

def test_same_rows_render_byte_identical_bodies_and_the_same_key(campaigns: dict[str, Campaign]) -> None:
    c = campaigns["finish_assessment"]
    a = renderer().prepare_batch(c, fa_rows())
    b = renderer().prepare_batch(c, fa_rows())  # a fresh renderer: nothing cached decides the bytes
    assert a.body == b.body
    assert a.idempotency_key == b.idempotency_key
    assert a.row_ids == (101, 102, 103)
    assert a.campaign == "finish_assessment"
    ids_digest = hashlib.sha256(b"101,102,103").hexdigest()[:16]
    assert a.idempotency_key == f"mf-101-{ids_digest}"
    # canonical JSON: sorted keys, no spaces, UTF-8
    emails = json.loads(a.body)
    assert a.body == json.dumps(emails, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
    assert [e["to"] for e in emails] == [["user0@example.com"], ["user1@example.com"], ["user2@example.com"]]
    assert [e["subject"] for e in emails] == [f"Name{i}, your assessment is waiting for you" for i in range(3)]
    assert emails[0]["from"] == "Practice Team <practice@mail.example.com>"
    assert emails[0]["reply_to"] == "support@example.com"
    assert emails[0]["tags"] == [{"name": "campaign", "value": "finish_assessment"}]
    assert f"{APP}/assessments/900" in emails[0]["html"] and f"{APP}/assessments/900" in emails[0]["text"]


def test_a_different_subset_gets_a_different_key(campaigns: dict[str, Campaign]) -> None:
    c = campaigns["finish_assessment"]
    rows = fa_rows(3)
    full = renderer().prepare_batch(c, rows)
    subset = renderer().prepare_batch(c, [rows[0], rows[2]])
    assert subset.idempotency_key != full.idempotency_key
    assert subset.idempotency_key.startswith("mf-101-")  # same first row, different digest
    assert subset.row_ids == (101, 103)
    assert json.loads(subset.body) == [json.loads(full.body)[0], json.loads(full.body)[2]]


def test_key_is_at_most_256_characters_even_for_huge_ids() -> None:
    key = idempotency_key("finish_assessment", [9_223_372_036_854_775_807] * 100)
    assert key.startswith("mf-9223372036854775807-")
    assert len(key) == len("mf-9223372036854775807-") + 16
    assert len(key) <= 256


def test_marketing_campaign_has_list_unsubscribe_headers(campaigns: dict[str, Campaign]) -> None:
    r = renderer()
    c = campaigns["finish_assessment"]
    row = fa_rows(1)[0]
    email = r.render_email(c, row)
    token = r.signer.token(row.user_id, "finish_assessment")
    assert email["headers"] == {
        "X-Mailflow-Send-Id": "101",
        "X-Mailflow-Campaign": "finish_assessment",
        "List-Unsubscribe": f"<{PUBLIC}/u/{token}>",
        "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
    }
    assert r.signer.verify(token) == (5000, "finish_assessment")
    assert f"{PUBLIC}/u/{token}" in email["text"]


def test_non_marketing_campaign_has_no_list_unsubscribe_headers(campaigns: dict[str, Campaign]) -> None:
    c = dataclasses.replace(campaigns["finish_assessment"], marketing=False)
    email = renderer().render_email(c, fa_rows(1)[0])
    assert email["headers"] == {"X-Mailflow-Send-Id": "101", "X-Mailflow-Campaign": "finish_assessment"}


def test_send_id_header_equals_each_row_id(campaigns: dict[str, Campaign]) -> None:
    rows = [MintedRow(id=i, user_id=10 + i, email=f"p{i}@example.com", context={"first_name": None})
            for i in (7, 42, 1000)]
    batch = renderer().prepare_batch(campaigns["first_practice"], rows)
    assert [e["headers"]["X-Mailflow-Send-Id"] for e in json.loads(batch.body)] == ["7", "42", "1000"]
    assert batch.row_ids == (7, 42, 1000)


def test_html_is_autoescaped_and_text_is_not(campaigns: dict[str, Campaign]) -> None:
    row = MintedRow(id=1, user_id=2, email="x@example.com", context={"first_name": "<script>alert(1)</script>"})
    email = renderer().render_email(campaigns["first_practice"], row)
    assert "<p style=\"margin:0 0 16px;\">Hi &lt;script&gt;alert(1)&lt;/script&gt;,</p>" in email["html"]
    assert "<script>" not in email["html"]
    assert email["text"].startswith("Hi <script>alert(1)</script>,\n")


def test_missing_first_name_falls_back_and_missing_column_is_an_error(campaigns: dict[str, Campaign]) -> None:
    row = MintedRow(id=1, user_id=2, email="x@example.com", context={"first_name": "  "})
    email = renderer().render_email(campaigns["first_practice"], row)
    assert email["text"].startswith("Hi there,\n")
    import jinja2

    with pytest.raises(jinja2.UndefinedError, match="assessment_id"):
        renderer().render_email(campaigns["finish_assessment"],
                                MintedRow(id=1, user_id=2, email="x@example.com",
                                          context={"first_name": "A", "assessment_kind": "verbal"}))


def test_a_row_that_cannot_render_fails_the_batch_naming_campaign_template_and_user(
        campaigns: dict[str, Campaign]) -> None:
    from mailflow.sendloop.render import RenderError

    rows = fa_rows(2)
    broken = MintedRow(id=200, user_id=7777, email="x@example.com", context={"first_name": "A"})
    with pytest.raises(RenderError, match=r"^campaign 'finish_assessment': cannot render the email for user 7777 "
                                          r"\(template 'finish_assessment'; chunk not minted\): UndefinedError: .*"
                                          r"assessment_(id|kind)"):
        renderer().prepare_batch(campaigns["finish_assessment"], [*rows, broken])


# -- reconcile by index --------------------------------------------------------------------------

def data(*ids: str) -> list[dict[str, str]]:
    return [{"id": i} for i in ids]


def test_all_accepted() -> None:
    out = reconcile_by_index(3, {"data": data("a", "b", "c"), "errors": []})
    assert out == Accepted(ids={0: "a", 1: "b", 2: "c"}, rejected={})


def test_all_accepted_without_errors_key() -> None:
    assert reconcile_by_index(2, {"data": data("a", "b")}) == Accepted(ids={0: "a", 1: "b"}, rejected={})


def test_rejection_in_the_middle_maps_ids_over_the_other_indices_in_order() -> None:
    out = reconcile_by_index(5, {"data": data("e0", "e1", "e3", "e4"),
                                 "errors": [{"index": 2, "message": "Invalid `to` field."}]})
    assert out == Accepted(ids={0: "e0", 1: "e1", 3: "e3", 4: "e4"}, rejected={2: "Invalid `to` field."})


def test_all_rejected() -> None:
    out = reconcile_by_index(3, {"data": [], "errors": [{"index": 2, "message": "m2"}, {"index": 0, "message": "m0"},
                                                        {"index": 1, "message": ""}]})
    assert out == Accepted(ids={}, rejected={0: "m0", 1: "rejected by provider", 2: "m2"})


@pytest.mark.parametrize("payload,reason", [
    ({"data": data("a", "b")}, "ambiguous response: 2 ids + 0 errors != 3 emails sent"),
    ({"data": data("a", "b", "c", "d")}, "ambiguous response: 4 ids + 0 errors != 3 emails sent"),
    ({"data": data("a"), "errors": [{"index": 1, "message": "x"}]},
     "ambiguous response: 1 ids + 1 errors != 3 emails sent"),
])
def test_count_mismatch_is_unknown(payload: Any, reason: str) -> None:
    assert reconcile_by_index(3, payload) == Unknown(reason=reason)


@pytest.mark.parametrize("err", [
    {"index": 3, "message": "out of range"},
    {"index": -1, "message": "negative"},
    {"index": "1", "message": "string index"},
    {"index": 1.0, "message": "float index"},
    {"index": True, "message": "bool index"},
    {"message": "no index"},
    "not an object",
])
def test_bad_error_index_is_unknown(err: Any) -> None:
    out = reconcile_by_index(3, {"data": data("a", "b"), "errors": [err]})
    assert out == Unknown(reason=f"ambiguous response: bad error index {err!r}")


def test_duplicate_error_index_is_unknown() -> None:
    errs = [{"index": 1, "message": "x"}, {"index": 1, "message": "y"}]
    out = reconcile_by_index(3, {"data": data("a"), "errors": errs})
    assert out == Unknown(reason=f"ambiguous response: bad error index {errs[1]!r}")


@pytest.mark.parametrize("payload", [None, [], "ok", {"errors": []}, {"data": None}, {"data": {"id": "a"}}])
def test_missing_data_is_unknown(payload: Any) -> None:
    out = reconcile_by_index(1, payload)
    assert isinstance(out, Unknown)
    assert out.reason == f"ambiguous response: no data array ({str(payload)[:200]})"
    assert (out.fatal, out.stop_run) == (False, None)


def test_errors_not_an_array_is_unknown() -> None:
    assert reconcile_by_index(1, {"data": data("a"), "errors": {"index": 0}}) == Unknown(
        reason="ambiguous response: errors is not an array")


@pytest.mark.parametrize("item", [{"id": ""}, {"id": 5}, {}, "a", None])
def test_data_item_without_a_string_id_is_unknown(item: Any) -> None:
    out = reconcile_by_index(2, {"data": [{"id": "a"}, item]})
    assert out == Unknown(reason=f"ambiguous response: data item without id {item!r}")


def test_duplicate_ids_are_unknown() -> None:
    out = reconcile_by_index(3, {"data": data("a", "b", "a")})
    assert out == Unknown(reason="ambiguous response: duplicate provider ids")


# -- unsubscribe tokens --------------------------------------------------------------------------

def test_token_round_trip_and_shape() -> None:
    s = signer_from_secret(SECRET)
    token = s.token(42, "finish_assessment")
    kid, uid, list_id, sig = token.split(".")
    assert (kid, uid, list_id) == ("k1", "42", "finish_assessment")
    assert len(sig) == 26 and sig == sig.lower() and set(sig) <= set("abcdefghijklmnopqrstuvwxyz234567")
    assert s.verify(token) == (42, "finish_assessment")
    assert s.token(42, "finish_assessment") == token  # deterministic
    assert s.verify(s.token(7, "all")) == (7, "all")


def _swap_last(sig: str) -> str:
    return sig[:-1] + ("a" if sig[-1] != "a" else "b")


def test_tampered_signature_user_or_list_is_refused() -> None:
    s = signer_from_secret(SECRET)
    kid, uid, list_id, sig = s.token(42, "upgrade_offer").split(".")
    with pytest.raises(InvalidToken, match="bad signature"):
        s.verify(f"{kid}.{uid}.{list_id}.{_swap_last(sig)}")
    with pytest.raises(InvalidToken, match="bad signature"):
        s.verify(f"{kid}.43.{list_id}.{sig}")
    with pytest.raises(InvalidToken, match="bad signature"):
        s.verify(f"{kid}.{uid}.all.{sig}")
    with pytest.raises(InvalidToken, match="bad signature"):
        s.verify(f"{kid}.{uid}.{list_id}.{sig[:-1]}")  # truncated


@pytest.mark.parametrize("text", ["", "k1.42.all", "k1.42.all.sig.extra", "k1.x42.all.abc", "k1.42.ALL-x.abc"])
def test_malformed_tokens_are_refused(text: str) -> None:
    with pytest.raises(InvalidToken):
        signer_from_secret(SECRET).verify(text)


def test_unknown_key_id_is_refused() -> None:
    other = signer_from_secret("another-secret-0123456789", kid="k9")
    token = other.token(42, "all")
    with pytest.raises(InvalidToken, match="malformed token or unknown key"):
        signer_from_secret(SECRET).verify(token)


def test_rotation_old_key_verifies_new_key_signs() -> None:
    old = signer_from_secret(SECRET, kid="k1")
    old_token = old.token(42, "practice_tips")
    new = signer_from_secret("rotated-secret-abcdefghijklmnop", kid="k2", old={"k1": SECRET})
    assert new.current_kid == "k2"
    assert new.verify(old_token) == (42, "practice_tips")
    new_token = new.token(42, "practice_tips")
    assert new_token.startswith("k2.42.practice_tips.")
    assert new.verify(new_token) == (42, "practice_tips")
    with pytest.raises(InvalidToken, match="unknown key"):
        old.verify(new_token)
    # the old key id with a signature of the new secret does not verify
    forged = "k1." + new_token.split(".", 1)[1]
    with pytest.raises(InvalidToken, match="bad signature"):
        new.verify(forged)


@pytest.mark.parametrize("decorate", [
    lambda t: t + ".", lambda t: t + ")", lambda t: t + ">", lambda t: t + "',", lambda t: f"  {t}\n",
    lambda t: t.upper(), lambda t: t.upper() + "!",
])
def test_trailing_punctuation_whitespace_and_uppercase_are_tolerated(decorate: Any) -> None:
    s = signer_from_secret(SECRET)
    assert s.verify(decorate(s.token(42, "first_practice"))) == (42, "first_practice")


def test_signer_configuration_is_validated() -> None:
    with pytest.raises(ValueError, match="shorter than 16 bytes"):
        signer_from_secret("short")
    with pytest.raises(ValueError, match="must be 1-16 of"):
        signer_from_secret(SECRET, kid="K1")
    with pytest.raises(ValueError, match="not in the key ring"):
        UnsubscribeSigner(keys={"k1": SECRET.encode()}, current_kid="k2")
    with pytest.raises(ValueError, match="list id"):
        signer_from_secret(SECRET).token(1, "Bad-List")


@pytest.mark.parametrize("uid", ["\u00b2", "1\u00b3", "\u2460"])  # superscript two, "1³", circled one
def test_a_non_ascii_digit_user_id_is_an_invalid_token(uid: str) -> None:
    s = signer_from_secret(SECRET)
    sig = s.token(2, "all").split(".")[3]
    with pytest.raises(InvalidToken):
        s.verify(f"k1.{uid}.all.{sig}")


def test_fullwidth_digits_are_not_a_second_spelling_of_a_token() -> None:
    s = signer_from_secret(SECRET)
    sig = s.token(42, "all").split(".")[3]
    with pytest.raises(InvalidToken):
        s.verify(f"k1.\uff14\uff12.all.{sig}")
