"""Templates cannot run code in the worker: subjects and template files render in Jinja2's sandbox,
and a campaign whose subject or template reaches outside it is refused when it is loaded or created
(naming the campaign and the field), before anything is rendered, provisioned or sent.

Each payload would run ``touch <marker>`` (or, ``format_string``, read the interpreter's globals) in an
unsandboxed environment; the witness is that the marker file never appears.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jinja2
import pytest
from scheduled_rig import (
    ALL_DAY,
    Rig,
    rig,  # noqa: F401  (fixture)
)

from mailflow.campaigns import CAMPAIGNS_DIR, load_campaigns
from mailflow.campaigns.templating import UnsafeTemplateError, subject_template
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import MintedRow
from mailflow.sendloop.render import Renderer, RenderError, template_env
from mailflow.sources import scheduled

# {marker} is replaced by the path of a file the payload would create if it ran
PAYLOADS = {
    "mro_subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "cycler_globals": "Hi {{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "lipsum_globals": "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
    "template_reference": "{{ self._TemplateReference__context.joiner.__init__.__globals__.os.system('touch {marker}') }}",
    "computed_names": ("{{ (cycler|attr('_' ~ '_init__')|attr('_' ~ '_globals__'))['os'].system('touch {marker}') }}"),
    "format_string": "{{ '{0.__init__.__globals__[os].system}'.format(cycler) }}{{ 'touch {marker}' }}",
}


def _payload(kind: str, marker: Path) -> str:
    return PAYLOADS[kind].replace("{marker}", str(marker))


def _spec(subject: str) -> dict[str, object]:
    return {"name": "spring_outreach", "template": "outreach", "subject": subject,
            "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users"} | ALL_DAY


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_template_cannot_run_code_in_the_worker(rig: Rig, tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "pwned"
    payload = _payload(kind, marker)
    # 1. a scheduled campaign spec (TOML, as an operator hands it in): refused at creation, by name
    spec_file = tmp_path / "spring.toml"
    spec_file.write_text('name = "spring_outreach"\ntemplate = "outreach"\n'
                         f"subject = '''{payload}'''\n"
                         'from = "Outreach <outreach@mail.example.com>"\nrecipients_sql = "free_plan_users"\n')
    with pytest.raises(ValueError, match=r"campaign 'spring_outreach': subject refused: .*sandbox|unsafe"):
        scheduled.create_campaign(rig.db, scheduled.load_spec(spec_file))
    assert rig.db.execute("select count(*) from mail.campaign").fetchone() == (0,)

    # 2. a campaign stored before subjects were checked: provisioning refuses it, provisions nothing
    rig.users(2)
    cid = rig.campaign("spring_outreach", **ALL_DAY)
    rig.db.execute("update mail.campaign set subject = %s where id = %s", (payload, cid))
    with pytest.raises(ValueError, match=r"campaign 'spring_outreach': subject refused"):
        rig.provision(cid)
    assert rig.rows() == []

    # 3. a lifecycle campaign declaration: refused at load, naming the file, the campaign and the field
    tree = tmp_path / "campaigns"
    shutil.copytree(CAMPAIGNS_DIR, tree)
    toml = tree / "lifecycle.toml"
    text = toml.read_text(encoding="utf-8")
    toml.write_text(text.replace("subject = \"{{ user.first_name or 'Hi' }}, your assessment is waiting for you\"",
                                 f"subject = '''{payload}'''", 1), encoding="utf-8")
    assert toml.read_text(encoding="utf-8") != text
    with pytest.raises(ValueError, match=r"/campaigns/lifecycle\.toml: campaign 'finish_assessment': subject refused: "):
        load_campaigns(toml)

    # 4. a template file (the HTML body) that reaches out: refused at load, naming campaign and file
    toml.write_text(text, encoding="utf-8")
    html = tree / "templates" / "finish_assessment.html.j2"
    body = html.read_text(encoding="utf-8")
    html.write_text(body.replace("{%- endblock %}", payload + "{%- endblock %}", 1), encoding="utf-8")
    assert payload in html.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=r"/campaigns/lifecycle\.toml: campaign 'finish_assessment': "
                                         r"template finish_assessment.html.j2 refused: "):
        load_campaigns(toml)

    # 5. and if one gets past loading anyway (built in code), the sandbox refuses it at render time
    campaign = next(c for c in load_campaigns() if c.name == "finish_assessment")
    row = MintedRow(id=1, user_id=7, email="u7@example.com",
                    context={"first_name": "Ann", "assessment_id": 3, "assessment_kind": "numerical"})
    signer = signer_from_secret("test-secret-0123456789abcdef")
    renderer = Renderer(signer, "https://mail.example.com", "https://app.example.com", mailto="")
    with pytest.raises(RenderError, match="UnsafeTemplateError"):
        renderer.prepare_batch(dataclasses.replace(campaign, subject=payload), [row])
    renderer = Renderer(signer, "https://mail.example.com", "https://app.example.com",
                        env=template_env(tree / "templates"), mailto="")
    with pytest.raises(RenderError, match="SecurityError|UndefinedError"):
        renderer.prepare_batch(campaign, [row])

    assert not marker.exists()


def test_sandboxed_subjects_render_as_before() -> None:
    # plain text (no HTML escaping in a header), strict about missing variables, filters allowed
    t = subject_template("{{ user.first_name | default('there') }} & co: {{ campaign | upper }}")
    assert t.render(user={"first_name": "Ann <A&B>"}, campaign="spring") == "Ann <A&B> & co: SPRING"
    with pytest.raises(UnsafeTemplateError, match="'subject' uses '__class__'"):
        subject_template("{{ user.__class__ }}")


def test_the_renderer_refuses_an_environment_without_the_sandbox() -> None:
    with pytest.raises(TypeError, match="sandboxed"):
        Renderer(signer_from_secret("test-secret-0123456789abcdef"), "https://mail.example.com",
                 "https://app.example.com", env=jinja2.Environment(), mailto="")
