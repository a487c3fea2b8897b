"""The campaigns folder: where campaign files are found, the one way they are read, and their content hash.

A folder holds ``lifecycle.toml`` (the lifecycle campaigns and the contact policy), ``audiences/*.sql``,
``recipients/*.sql`` (scheduled campaigns' lists) and ``templates/*.j2``. Which folder
(:meth:`CampaignFolder.resolve`, docs/operations.md "Campaigns folder"):

1. ``MAILFLOW_CAMPAIGNS_DIR`` if set: an absolute path, or a path relative to the DAG folder. A
   configured folder that does not exist is an error, never a silent fallback (the examples would
   go to real users).
2. ``campaigns/`` next to the DAG files (the DAG bundle), if it exists: campaigns deploy with the DAGs.
3. The examples packaged with mailflow (the demo's content), the folder of this module.

Nothing is cached between calls: every load reads the files again, so a deployed edit is used by the
next run without a reinstall. The one cache below the loader (the template sandbox check) is keyed by
the template text and the folder's mtimes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

from mailflow import settings

EXAMPLES_DIR = Path(__file__).parent
"""The packaged examples (the demo's campaigns): used when no campaigns folder is deployed."""

CAMPAIGNS_DIR_ENV = "MAILFLOW_CAMPAIGNS_DIR"

_NAME = re.compile(r"^[a-z0-9_]{1,64}$")


class CampaignFileError(ValueError):
    """A campaign file is missing, malformed or names an unknown or bad field.

    ``str(exc)`` is ``<file>: <where>: <what>``; ``path`` is the file and ``field`` the field (or
    ``None`` for a file that is not valid TOML at all), so a DAG import error names both."""

    def __init__(self, path: Path, field: str | None, message: str):
        self.path, self.field = path, field
        super().__init__(f"{path}: {message}")


def hash_content(definition: Mapping[str, Any], files: Mapping[str, str]) -> str:
    """The content hash of a campaign: 16 hex of sha256 over its definition (a JSON-able mapping,
    keys sorted; other values as text) and its files (``{name relative to the folder: text}``).

    Stable across processes, machines and file order; any change of a field's value, a file's text
    or a file's name gives another hash.
    """
    doc = json.dumps({"definition": definition, "files": dict(files)}, sort_keys=True, default=str,
                     ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CampaignFolder:
    """One campaigns folder (see the module docstring).

    :ivar root: the folder (absolute).
    :ivar origin: how it was chosen: ``"MAILFLOW_CAMPAIGNS_DIR"``, ``"dag bundle"``,
        ``"packaged examples"`` or ``"given"`` (a caller named it).
    """

    root: Path
    origin: str = "given"

    @classmethod
    def resolve(cls, dag_folder: str | os.PathLike[str] | None = None) -> CampaignFolder:
        """The folder to read campaigns from, chosen as in the module docstring.

        :param dag_folder: the folder of the DAG files (a task passes its DAG file's folder, the
            DAG bundle as the worker sees it); ``None``: Airflow's ``[core] dags_folder`` as the
            environment gives it (``AIRFLOW__CORE__DAGS_FOLDER``, else ``$AIRFLOW_HOME/dags``).
        :raises CampaignFileError: if ``MAILFLOW_CAMPAIGNS_DIR`` names a folder that does not exist.
        """
        base = Path(dag_folder) if dag_folder is not None else settings.dags_folder()
        configured = os.environ.get(CAMPAIGNS_DIR_ENV, "").strip()
        if configured:
            path = Path(configured).expanduser()
            path = path if path.is_absolute() else base / path
            if not path.is_dir():
                raise CampaignFileError(path, None, f"{CAMPAIGNS_DIR_ENV} names this folder, which does not exist")
            return cls(path.resolve(), CAMPAIGNS_DIR_ENV)
        bundled = base / "campaigns"
        if bundled.is_dir():
            return cls(bundled.resolve(), "dag bundle")
        return cls(EXAMPLES_DIR, "packaged examples")

    @property
    def lifecycle_file(self) -> Path:
        """``lifecycle.toml``: the lifecycle campaigns and the contact policy."""
        return self.root / "lifecycle.toml"

    @property
    def templates_dir(self) -> Path:
        """``templates/``: ``<template>.html.j2``, ``<template>.txt.j2`` and the layouts they use."""
        return self.root / "templates"

    def template_file(self, template: str, suffix: str) -> Path:
        """The file of template ``template`` with ``suffix`` (``.html.j2`` or ``.txt.j2``)."""
        return self.templates_dir / f"{template}{suffix}"

    def check_template_files(self, template: str, label: str) -> None:
        """Both files of a template exist (and its name is ``[a-z0-9_]``).

        :raises CampaignFileError: ``campaign '<label>': template = '<template>': <file> not found``.
        """
        for suffix in (".html.j2", ".txt.j2"):
            t = self.template_file(template, suffix)
            if not _NAME.match(template) or not t.is_file():
                raise CampaignFileError(t, "template", f"campaign {label!r}: template = {template!r}: file not found")

    def recipients_file(self, name: str, label: str) -> Path:
        """A scheduled campaign's recipients SQL file (``recipients/<name>.sql``).

        :raises CampaignFileError: naming the file and the field ``recipients_sql`` if it is missing.
        """
        stem = name[:-4] if name.endswith(".sql") else name
        path = self.root / "recipients" / f"{stem}.sql"
        if not _NAME.match(stem) or not path.is_file():
            raise CampaignFileError(path, "recipients_sql",
                                    f"campaign {label!r}: recipients_sql = {name!r}: file not found")
        return path

    def relative(self, path: Path) -> str:
        """``path`` relative to the folder (as the hash names files); the path itself if outside."""
        try:
            return path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return str(path)

    def template_sources(self, template: str) -> dict[str, str]:
        """The texts a template renders from: its two files and every template they extend, include
        or import by a literal name, recursively, as ``{path relative to the folder: text}``."""
        env = jinja2.Environment(autoescape=True)  # parsing only: nothing is rendered here
        out: dict[str, str] = {}
        todo = [f"{template}.html.j2", f"{template}.txt.j2"]
        while todo:
            name = todo.pop()
            key = f"templates/{name}"
            if key in out:
                continue
            path = self.templates_dir / name
            if not path.is_file():
                continue  # a missing layout is the template check's error, reported there
            out[key] = text = path.read_text(encoding="utf-8")
            try:
                refs = jinja2.meta.find_referenced_templates(env.parse(text))
            except jinja2.TemplateSyntaxError:
                continue  # reported by the template check
            todo += [r for r in refs if r is not None]
        return out

    def template_names(self) -> Iterator[str]:
        """The names of the campaign templates in ``templates/`` (files ``<name>.html.j2`` not
        starting with ``_``, which marks a layout)."""
        if self.templates_dir.is_dir():
            for f in sorted(self.templates_dir.glob("*.html.j2")):
                if not f.name.startswith("_"):
                    yield f.name.removesuffix(".html.j2")
