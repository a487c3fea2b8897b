"""A provider rejection that names a field of the CAMPAIGN (its sender, reply address, headers,
rendered subject or body) is the campaign's mistake, not the recipient's: it is withheld (charges
nobody) and stops the run with an alert; a rejection naming the recipient, or no field, still fails
that one row."""

from __future__ import annotations

import pytest

from mailflow.model.apply_by_index import campaign_field, reconcile_by_index
from mailflow.model.outcome import Accepted

FROM = ("Invalid `from` field. The email address needs to follow the `email@example.com` or "
        "`Name <email@example.com>` format.")
TO = "Invalid `to` field. The email address needs to follow the `email@example.com` or `Name <email@example.com>` format."


@pytest.mark.parametrize(("message", "field"), [
    (FROM, "from"),                                              # Resend's / the emulator's wording
    ("Missing `from` field.", "from"),
    ("The 'reply_to' field is invalid", "reply_to"),
    ('Invalid "headers" field. It must be an object of string values.', "headers"),
    ("Invalid `subject` field. It must be a non-empty string.", "subject"),
    ("invalid_from_address: the sender is not allowed", "from"),
    ("Invalid from address", "from"),                            # a bare field name before "address"
    (TO, None),                                                  # the recipient's own field
    ("Too many recipients in `to`: the maximum is 50.", None),
    ("The email address needs to follow the `email@example.com` format.", None),  # no field named
    ("recipient is on the suppression list", None),
    ("", None),
])
def test_campaign_field_is_classified_by_the_field_name_not_the_wording(message: str, field: str | None) -> None:
    assert campaign_field(message) == field


def test_campaign_level_rejection_is_withheld_and_charges_nobody() -> None:
    out = reconcile_by_index(3, {"data": [], "errors": [{"index": i, "message": FROM} for i in range(3)]})

    assert isinstance(out, Accepted)
    assert (out.ids, out.rejected) == ({}, {})
    assert out.withheld == {0: FROM, 1: FROM, 2: FROM}
    assert (out.fatal, out.campaign_field) == (True, "from")
    assert out.stop_run is not None and out.stop_run.startswith("campaign refused: `from`")


def test_a_mixed_answer_keeps_accepted_sent_recipient_rejections_failed_and_withholds_the_campaign_ones() -> None:
    payload = {"data": [{"id": "e-0"}, {"id": "e-3"}],
               "errors": [{"index": 1, "message": TO}, {"index": 2, "message": "Missing `from` field."}]}

    out = reconcile_by_index(4, payload)

    assert isinstance(out, Accepted)
    assert out.ids == {0: "e-0", 3: "e-3"}
    assert out.rejected == {1: TO}
    assert out.withheld == {2: "Missing `from` field."}
    assert (out.fatal, out.campaign_field) == (True, "from")


def test_recipient_rejections_alone_do_not_stop_the_run() -> None:
    out = reconcile_by_index(2, {"data": [{"id": "e-1"}], "errors": [{"index": 0, "message": TO}]})

    assert out == Accepted(ids={1: "e-1"}, rejected={0: TO})
    assert (out.withheld, out.fatal, out.stop_run, out.campaign_field) == ({}, False, None, None)


def test_a_rendered_field_refused_for_some_emails_is_about_their_data_not_the_campaign() -> None:
    subject = "Invalid `subject` field. It must be a non-empty string."
    some = reconcile_by_index(3, {"data": [{"id": "e-0"}, {"id": "e-2"}], "errors": [{"index": 1, "message": subject}]})
    every = reconcile_by_index(2, {"data": [], "errors": [{"index": 0, "message": subject},
                                                          {"index": 1, "message": subject}]})

    assert isinstance(some, Accepted) and (some.rejected, some.withheld, some.fatal) == ({1: subject}, {}, False)
    assert isinstance(every, Accepted) and (every.rejected, every.campaign_field) == ({}, "subject")
    assert every.withheld == {0: subject, 1: subject}
