"""Secrets read from connections never reach a task log (issue 13): the Resend API key, the
unsubscribe signing secret, its ``extra.old_keys`` (which still verify tokens) and the send-log
password are registered with Airflow's secrets masker when they are read; logging them through the
task logger prints ``***``.

The logging runs in a subprocess configured as Airflow's task logging is (``airflow.sdk.log.
configure_logging``, JSON lines, with the masking processor), so the test session's logging is
left alone. A value the connections hold under a name that is not secret stays visible: the
assertions can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

API_KEY = "re_live_APIKEY0123456789abcdef"
SIGNING = "signing-CURRENT-9f8e7d6c5b4a"
OLD_1 = "signing-OLD1-0a1b2c3d4e5f"
OLD_2 = "signing/OLD2+needs&quoting"
DB_PASSWORD = "pg-PASSWORD-5566778899"
VISIBLE = "visible-note-CCCC3333"

PROBE = f"""
import io, json, logging, sys
from airflow.sdk.log import configure_logging
buf = io.StringIO()
configure_logging(json_output=True, output=buf, sending_to_supervisor=False, cache_logger_on_first_use=False)
from mailflow.orchestration.tasks import unsubscribe_signer
from mailflow.provider.hook import ResendHook
from mailflow import masking, settings
from airflow.sdk import BaseHook
signer = unsubscribe_signer()
ResendHook("resend_default").settings()
masking.mask_connection(BaseHook.get_connection(settings.SEND_LOG_CONN_ID))  # what send_log_connection() does
log = logging.getLogger("airflow.task")
log.info("key=%s current=%s old1=%s old2=%s db=%s note=%s", {API_KEY!r}, {SIGNING!r}, {OLD_1!r}, {OLD_2!r},
         {DB_PASSWORD!r}, {VISIBLE!r})
logging.getLogger("mailflow.orchestration.tasks").warning("quoted old key: %s", {__import__('urllib.parse').parse.quote(OLD_2, safe='')!r})
sys.stdout.write(buf.getvalue())
"""


def test_connection_secrets_are_masked_in_task_logs(tmp_path: Path) -> None:
    env = os.environ.copy()
    env["PYTHONPATH"] = str(ROOT / "include")
    env["AIRFLOW_CONN_RESEND_DEFAULT"] = json.dumps({
        "conn_type": "resend", "host": "http://127.0.0.1:9", "password": API_KEY, "extra": {"note": VISIBLE}})
    env["AIRFLOW_CONN_MAIL_UNSUBSCRIBE"] = json.dumps({
        "conn_type": "generic", "password": SIGNING, "extra": {"kid": "k3", "old_keys": {"k1": OLD_1, "k2": OLD_2}}})
    env["AIRFLOW_CONN_SEND_LOG_DB"] = json.dumps({
        "conn_type": "postgres", "host": "127.0.0.1", "login": "mailflow", "password": DB_PASSWORD, "schema": "x"})
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines if not line["event"].startswith("Skipping masking")]  # "k3" is short
    assert events == ["key=*** current=*** old1=*** old2=*** db=*** note=" + VISIBLE, "quoted old key: ***"]
    for secret in (API_KEY, SIGNING, OLD_1, OLD_2, DB_PASSWORD):
        assert secret not in out.stdout
