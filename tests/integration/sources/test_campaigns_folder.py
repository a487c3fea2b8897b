"""The campaigns folder: an edit in the configured folder (``MAILFLOW_CAMPAIGNS_DIR``) changes the
next lifecycle run's emails and the content hash recorded on its batches, in the same process (no
reinstall, no reload); a missing folder falls back to the packaged examples. Real PostgreSQL, the
emulator over HTTP, the renderer and folder resolution the DAG task uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from conftest import UNSUBSCRIBE_SECRET
from lifecycle_rig import END, INTERVAL, RUN, H, Rig, add_user, rig  # noqa: F401  (fixture)

from mailflow.campaigns import EXAMPLES_DIR, CampaignFileError, CampaignFolder, load_campaigns
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import DataInterval
from mailflow.orchestration.tasks import campaign_folder, campaigns_param
from mailflow.sendloop.render import Renderer, template_env
from mailflow.sources.lifecycle import run_lifecycle


def task_run(rig: Rig, dag_file: Path, interval: DataInterval) -> list[Any]:
    """What the lifecycle task does with its campaign files: resolve the folder from its DAG file,
    load the asked-for campaigns, render with that folder's templates (a new renderer per run)."""
    folder = campaign_folder({"dag": SimpleNamespace(fileloc=str(dag_file))})
    campaigns = campaigns_param({"campaigns": ["first_practice"]}, folder)
    renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com",
                        env=template_env(folder.templates_dir))
    return run_lifecycle(rig.store(), rig.client(), renderer, campaigns, interval, run=RUN)


def batches(db: psycopg.Connection) -> list[tuple[str, str, str | None, dict[str, Any]]]:
    """(user's address, batch key, content hash, the email as sent) per sent row, joined as
    docs/send_log.md shows (the email: the row's entry of the stored request bytes)."""
    rows = db.execute("select l.email, b.idempotency_key, b.campaign_content_hash, b.body, l.batch_index"
                      " from mail.send_log l join mail.send_batch b using (idempotency_key)"
                      " where l.status = 'sent' order by l.id").fetchall()
    return [(r[0], r[1], r[2], json.loads(bytes(r[3]))[r[4]]) for r in rows]


def test_an_edit_in_the_configured_folder_changes_the_next_run_and_its_recorded_hash(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "team_campaigns"
    shutil.copytree(EXAMPLES_DIR, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    dag_file = tmp_path / "dags" / "lifecycle_emails.py"  # a bundle without campaigns/: the env decides
    dag_file.parent.mkdir()
    monkeypatch.setenv("MAILFLOW_CAMPAIGNS_DIR", str(folder))
    add_user(rig.db, 1, email="first@example.com", signed_up_at=END - H / 2)
    before = {c.name: c.content_hash for c in load_campaigns(folder=CampaignFolder(folder))}
    assert before == {c.name: c.content_hash for c in load_campaigns()}  # same content as the examples

    [s1] = task_run(rig, dag_file, INTERVAL)
    assert (s1.campaign, s1.sent) == ("first_practice", 1)

    # the team edits the campaign in its folder: a template and the subject
    html = folder / "templates" / "first_practice.html.j2"
    html.write_text(html.read_text(encoding="utf-8").replace("{% block content -%}",
                                                            "{% block content -%}<p>Spring edition</p>", 1),
                    encoding="utf-8")
    toml = folder / "lifecycle.toml"
    toml.write_text(toml.read_text(encoding="utf-8").replace(
        'subject = "Start your first practice test in 10 minutes"',
        'subject = "Spring: your first practice test takes 10 minutes"', 1), encoding="utf-8")
    after = {c.name: c.content_hash for c in load_campaigns(folder=CampaignFolder(folder))}
    assert after["first_practice"] != before["first_practice"]
    # only the edited campaign's hash moved (finish_assessment shares the layouts, not this template)
    assert {k: v for k, v in after.items() if k != "first_practice"} == \
        {k: v for k, v in before.items() if k != "first_practice"}

    add_user(rig.db, 2, email="second@example.com", signed_up_at=END + H / 2)
    [s2] = task_run(rig, dag_file, DataInterval(END, END + H))
    assert (s2.campaign, s2.sent) == ("first_practice", 1)

    first, second = rig.outbox()
    assert first["to"] == ["first@example.com"] and second["to"] == ["second@example.com"]
    assert first["subject"] == "Start your first practice test in 10 minutes"
    assert second["subject"] == "Spring: your first practice test takes 10 minutes"
    recorded = batches(rig.db)
    assert [(r[0], r[2]) for r in recorded] == [("first@example.com", before["first_practice"]),
                                                ("second@example.com", after["first_practice"])]
    assert len({r[1] for r in recorded}) == 2
    old, new = recorded[0][3], recorded[1][3]
    assert (old["subject"], new["subject"]) == (first["subject"], second["subject"])
    assert "Spring edition" not in old["html"] and "<p>Spring edition</p>" in new["html"]
    assert "Spring" not in old["text"] + new["text"]  # the text template was not edited


def test_the_dag_bundles_campaigns_folder_is_used_and_an_absent_one_falls_back_to_the_examples(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAILFLOW_CAMPAIGNS_DIR", raising=False)
    dags = tmp_path / "dags"
    dags.mkdir()
    fallback = CampaignFolder.resolve(dags)
    assert (fallback.root, fallback.origin) == (EXAMPLES_DIR, "packaged examples")
    assert [c.name for c in load_campaigns(folder=fallback)] == \
        ["finish_assessment", "first_practice", "upgrade_offer", "practice_tips"]

    shutil.copytree(EXAMPLES_DIR, dags / "campaigns", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    toml = dags / "campaigns" / "lifecycle.toml"
    toml.write_text(toml.read_text(encoding="utf-8").split("[[campaign]]")[0] + "[[campaign]]" +
                    toml.read_text(encoding="utf-8").split("[[campaign]]")[2], encoding="utf-8")
    bundled = CampaignFolder.resolve(dags)
    assert (bundled.root, bundled.origin) == ((dags / "campaigns").resolve(), "dag bundle")
    assert [c.name for c in load_campaigns(folder=bundled)] == ["first_practice"]

    # a relative MAILFLOW_CAMPAIGNS_DIR is relative to the DAG folder; a missing one is an error, not the examples
    monkeypatch.setenv("MAILFLOW_CAMPAIGNS_DIR", "campaigns")
    assert CampaignFolder.resolve(dags).root == (dags / "campaigns").resolve()
    monkeypatch.setenv("MAILFLOW_CAMPAIGNS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(CampaignFileError, match=r"nowhere: MAILFLOW_CAMPAIGNS_DIR names this folder, which does not"):
        CampaignFolder.resolve(dags)
