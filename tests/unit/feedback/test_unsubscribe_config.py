"""Where the unsubscribe endpoint finds its signing secret (env or an AIRFLOW_CONN_* value), and
that a missing or broken configuration is an Unavailable that never echoes a secret."""

from __future__ import annotations

import json

import pytest

from mailflow.feedback.unsubscribe_app import Unavailable, signer_from_env
from mailflow.feedback.unsubscribe_tokens import signer_from_secret

SECRET = "test-secret-0123456789abcdef"
OLD = "old-secret-0123456789abcdef"


def test_env_secret_with_rotation_and_max_age() -> None:
    s = signer_from_env({"MAILFLOW_UNSUBSCRIBE_SECRET": SECRET, "MAILFLOW_UNSUBSCRIBE_KID": "k2",
                         "MAILFLOW_UNSUBSCRIBE_OLD_KEYS": json.dumps({"k1": OLD}),
                         "MAILFLOW_UNSUBSCRIBE_MAX_AGE_DAYS": "365"})
    assert (s.current_kid, sorted(s.keys), s.max_age_days) == ("k2", ["k1", "k2"], 365)
    assert s.verify(signer_from_secret(OLD, kid="k1").token(3, "all")) == (3, "all")


@pytest.mark.parametrize("value", [
    json.dumps({"conn_type": "generic", "password": SECRET, "extra": {"kid": "k2", "old_keys": {"k1": OLD}}}),
    json.dumps({"conn_type": "generic", "password": SECRET, "extra": json.dumps({"kid": "k2", "old_keys": {"k1": OLD}})}),
    "generic://:" + SECRET + "@/?__extra__=" + json.dumps({"kid": "k2", "old_keys": {"k1": OLD}}),
])
def test_airflow_connection_in_the_environment(value: str) -> None:
    s = signer_from_env({"AIRFLOW_CONN_MAIL_UNSUBSCRIBE": value})
    assert (s.current_kid, sorted(s.keys)) == ("k2", ["k1", "k2"])
    assert s.keys["k2"] == SECRET.encode()


def test_a_uri_with_a_percent_encoded_secret_and_a_kid() -> None:
    s = signer_from_env({"AIRFLOW_CONN_MAIL_UNSUBSCRIBE": "generic://:s%2Fecret%40with-specials-0123@/?kid=k5"})
    assert (s.current_kid, s.keys["k5"]) == ("k5", b"s/ecret@with-specials-0123")


def test_missing_secret_names_what_to_set() -> None:
    with pytest.raises(Unavailable, match="MAILFLOW_UNSUBSCRIBE_SECRET or AIRFLOW_CONN_MAIL_UNSUBSCRIBE"):
        signer_from_env({})


@pytest.mark.parametrize("env", [
    {"AIRFLOW_CONN_MAIL_UNSUBSCRIBE": '{"password": "' + SECRET + '", "extra": '},  # broken JSON
    {"MAILFLOW_UNSUBSCRIBE_SECRET": SECRET, "MAILFLOW_UNSUBSCRIBE_OLD_KEYS": "{" + OLD},
    {"MAILFLOW_UNSUBSCRIBE_SECRET": SECRET, "MAILFLOW_UNSUBSCRIBE_MAX_AGE_DAYS": "7"},
    {"MAILFLOW_UNSUBSCRIBE_SECRET": "short"},
    {"AIRFLOW_CONN_MAIL_UNSUBSCRIBE": json.dumps({"conn_type": "generic"})},  # no password
])
def test_broken_configuration_is_unavailable_without_echoing_secrets(env: dict[str, str]) -> None:
    with pytest.raises(Unavailable) as err:
        signer_from_env(env)
    assert SECRET not in str(err.value) and OLD not in str(err.value) and "short" not in str(err.value).replace(
        "shorter", "")
