"""The one way campaign templates are compiled: Jinja2's sandbox, everywhere.

A subject line comes from a campaign spec that an operator (or anyone who can write a spec) hands
to the worker, and the worker holds the API key, the send-log DSN and the signing secret. So every
template, the subject lines included, compiles in :class:`jinja2.sandbox.ImmutableSandboxedEnvironment`:
no attribute that starts with ``_`` (``__class__``, ``__globals__``, ``__subclasses__``), no
function or frame internals, no mutation of the objects a template is given (source of the rule:
Jinja2's sandbox documentation, https://jinja.palletsprojects.com/en/stable/sandbox/).

The sandbox is the guard at render time. Loading a campaign also checks each template up front
(:func:`check_template`), so a template that tries to leave the sandbox is refused when the
campaign is loaded or created, with the campaign and the field named, rather than on the first
email of a run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing


class UnsafeTemplateError(SecurityError):
    """A template reaches for something the sandbox forbids (an attribute that starts with ``_``,
    a function's or a frame's internals). A :class:`jinja2.TemplateError`; the message names the
    template and the attribute."""


class _SandboxedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with each named template looked up once per environment while ``auto_reload``
    is off (the project's setting): a child template asks for its layout on every render
    (``{% extends %}``), and Jinja2's own lookup (a locked LRU and a loader key) cost ~2 us of
    each email's ~60 us. Lookups with ``globals`` and with ``auto_reload`` on go to Jinja2."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._loaded: dict[tuple[str, str | None], jinja2.Template] = {}

    def get_template(self, name: str | jinja2.Template, parent: str | None = None,
                     globals: MutableMapping[str, Any] | None = None) -> jinja2.Template:
        if globals is not None or self.auto_reload or not isinstance(name, str):
            return super().get_template(name, parent, globals)
        template = self._loaded.get((name, parent))
        if template is None:
            template = self._loaded[(name, parent)] = super().get_template(name, parent)
        return template


def sandboxed_env(loader: jinja2.BaseLoader | None = None, *,
                  autoescape: bool | Callable[[str | None], bool] = False,
                  undefined: type[jinja2.Undefined] = jinja2.StrictUndefined) -> jinja2.Environment:
    """A sandboxed (immutable) Jinja2 environment with the project's settings: strict undefined
    (a missing variable is an error naming it), trailing newline kept, no ``stat()`` per render.

    :param loader: where named templates come from (``None``: only :meth:`from_string`).
    :param autoescape: ``True`` / ``False`` or a function of the template name (HTML on, text off).
    :param undefined: the Undefined class (tests and :func:`check_template` use a lenient one).
    """
    return _SandboxedEnvironment(loader=loader, autoescape=autoescape, undefined=undefined,
                                 keep_trailing_newline=True, auto_reload=False)


def _unsafe(name: object) -> bool:
    # the names every escape starts from (__class__, __globals__, __init__, __subclasses__); the
    # sandbox also refuses function and frame internals at render time, judged on the real object
    return isinstance(name, str) and name.startswith("_")


def _reaches(tree: nodes.Node) -> Iterator[str]:
    """Attribute names starting with ``_`` that a template asks for by a literal name."""
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter, nodes.Test)):
        if isinstance(node, nodes.Getattr) and _unsafe(node.attr):
            yield node.attr
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and _unsafe(node.arg.value):
            yield str(node.arg.value)
        elif isinstance(node, nodes.Filter | nodes.Test) and node.name == "attr":
            for arg in node.args:
                if isinstance(arg, nodes.Const) and _unsafe(arg.value):
                    yield str(arg.value)


class _Probe(jinja2.ChainableUndefined):
    """Lenient about missing variables (a probe does not know a campaign's columns) but raises the
    moment the sandbox refuses an attribute, however its name was computed."""

    def __init__(self, hint: str | None = None, obj: Any = missing, name: str | None = None,
                 exc: type[jinja2.TemplateRuntimeError] = jinja2.UndefinedError) -> None:
        if issubclass(exc, SecurityError):
            raise UnsafeTemplateError(hint or f"access to {name!r} is unsafe")
        super().__init__(hint, obj, name, exc)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:  # a missing function: not a security question
        raise jinja2.UndefinedError(f"{self._undefined_name!r} is undefined")


def check_template(source: str, name: str, loader: jinja2.BaseLoader | None = None) -> None:
    """Refuse a template that tries to leave the sandbox; return ``None`` if it stays inside.

    Two checks: the parsed template (and every template it extends or includes by a literal name,
    through ``loader``) asks for no forbidden attribute by a literal name, and a trial render in
    the sandbox with a sample context (``user`` with ``user_id`` and ``email``; anything else is
    undefined and renders empty) meets no attribute the sandbox refuses. Errors of the trial that
    are about missing data (undefined calls, type errors) are not this function's concern: they
    are reported when real rows are rendered.

    :param source: the template text.
    :param name: how the error names it (e.g. ``"subject"`` or ``"outreach.html.j2"``).
    :raises UnsafeTemplateError: naming ``name`` and the attribute.
    :raises jinja2.TemplateSyntaxError: if the text is not a valid template.
    """
    env = sandboxed_env(loader, undefined=_Probe)
    seen: set[str] = set()

    def walk(text: str, label: str) -> None:
        tree = env.parse(text, name=label)
        for attr in _reaches(tree):
            raise UnsafeTemplateError(f"template {label!r} uses {attr!r}, which the sandbox forbids "
                                      f"(no attribute starting with '_')")
        if loader is None:
            return
        for ref in jinja2.meta.find_referenced_templates(tree):
            if ref is not None and ref not in seen:
                seen.add(ref)
                walk(loader.get_source(env, ref)[0], ref)

    walk(source, name)
    ctx = {"user": {"user_id": 1, "email": "probe@example.invalid"}, "campaign": "probe",
           "unsubscribe_url": "https://example.invalid/u/probe", "app_url": "https://example.invalid"}
    try:
        env.from_string(source).render(ctx)
    except UnsafeTemplateError as exc:
        raise UnsafeTemplateError(f"template {name!r}: {exc}") from None
    except SecurityError as exc:  # e.g. a range() too large, str.format on a forbidden field
        raise UnsafeTemplateError(f"template {name!r}: {exc}") from None
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError):
        pass  # about data, not about the sandbox


def subject_template(text: str) -> jinja2.Template:
    """A campaign's subject line as a sandboxed Jinja2 template (plain text: no autoescape, strict
    undefined), after :func:`check_template`.

    :raises UnsafeTemplateError: if the subject tries to leave the sandbox.
    :raises jinja2.TemplateSyntaxError: if ``text`` is not a valid template.
    """
    _check_cached(text, "subject", None, 0)
    return _compiled_subject(text)


@functools.lru_cache(maxsize=256)
def _compiled_subject(text: str) -> jinja2.Template:
    """A subject line compiled once per process (a compiled template renders from any thread)."""
    return sandboxed_env().from_string(text)


@functools.lru_cache(maxsize=256)
def _check_cached(source: str, name: str, directory: str | None, stamp: int) -> None:
    """:func:`check_template` once per (text, directory state): loading campaigns compiles nothing twice."""
    check_template(source, name, jinja2.FileSystemLoader(directory) if directory else None)


def check_campaign_templates(label: str, subject: str, template: str, templates_dir: Path) -> None:
    """Check a campaign's subject and its ``<template>.html.j2`` / ``<template>.txt.j2`` files (and
    the layouts they extend) with :func:`check_template`; return ``None`` if all stay in the sandbox.

    :param label: the campaign's name, for the message.
    :raises ValueError: ``campaign '<label>': <field> ...`` naming the field (``subject`` or the
        template file) and what it reached for, or the syntax error.
    """
    # a template's layouts can change only with a file of the directory: their newest mtime is part of the key
    stamp = max((f.stat().st_mtime_ns for f in templates_dir.iterdir() if f.is_file()), default=0)
    fields: list[tuple[str, str, str | None]] = [("subject", subject, None)]
    fields += [(f"template {template}{suffix}", (templates_dir / f"{template}{suffix}").read_text(encoding="utf-8"),
                str(templates_dir)) for suffix in (".html.j2", ".txt.j2")]
    for field, source, directory in fields:
        try:
            _check_cached(source, field.removeprefix("template "), directory, stamp if directory else 0)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"campaign {label!r}: {field} is not a valid Jinja template: {exc}") from None
        except UnsafeTemplateError as exc:
            raise ValueError(f"campaign {label!r}: {field} refused: {exc}") from None


#: Names a template can read that Jinja2 itself provides while a template renders (never fixed).
_RUNTIME_NAMES = frozenset({"self", "super", "caller", "varargs", "kwargs", "loop"})


def _outside_blocks(node: nodes.Node) -> Iterator[nodes.Node]:
    """Every node under ``node`` that is not inside a ``{% block %}``."""
    for child in node.iter_child_nodes():
        if not isinstance(child, nodes.Block):
            yield child
            yield from _outside_blocks(child)


def fixed_blocks(env: jinja2.Environment, name: str, row_names: frozenset[str]) -> frozenset[str]:
    """The blocks of template ``name`` (with the layouts it extends) whose output cannot depend on
    the row being rendered: rendered once, their text may stand for every email of the campaign
    (:class:`mailflow.sendloop.render.Renderer` does so for the layout's header, call to action and
    footer pieces).

    A block is fixed when the definition that renders (the first in the chain from ``name`` to its
    last layout) reads, directly or through top-level ``{% set %}`` names, no name of
    ``row_names`` (the context names that differ per email), no global (``lipsum``, ``cycler``,
    ``range`` ...), no ``self``, ``super``, ``caller`` or ``loop``, uses no ``random`` filter, holds
    no nested block and is not ``scoped``. Any ``{% include %}`` or ``{% import %}`` in the chain,
    a computed layout name, or a name assigned anywhere but by a plain top-level ``{% set %}``
    makes the answer conservative (nothing fixed, or that name not fixed). Every other name is
    either a per-campaign context name or undefined, the same for every email.

    :raises jinja2.TemplateNotFound: if a template of the chain does not exist.
    """
    chain: list[nodes.Template] = []
    current: str | None = name
    while current is not None:
        if len(chain) > 16:
            return frozenset()
        tree = env.parse(env.loader.get_source(env, current)[0], name=current) if env.loader else None
        if tree is None:
            return frozenset()
        chain.append(tree)
        if any(True for _ in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport))):
            return frozenset()
        extends = [n for n in tree.body if isinstance(n, nodes.Extends)]
        if not extends:
            current = None
        elif len(extends) == 1 and isinstance(extends[0].template, nodes.Const) \
                and isinstance(extends[0].template.value, str):
            current = extends[0].template.value
        else:
            return frozenset()
    assigned: dict[str, list[nodes.Node]] = {}
    unsure: set[str] = set()
    for tree in chain:
        plain = [n for n in tree.body if isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name)]
        targets = {id(n.target) for n in plain}
        for assign in plain:
            assert isinstance(assign.target, nodes.Name)
            assigned.setdefault(assign.target.name, []).append(assign.node)
        for node in _outside_blocks(tree):
            if isinstance(node, nodes.Name) and node.ctx != "load" and id(node) not in targets:
                unsure.add(node.name)  # a for target, a macro parameter, a set inside an if ...
            elif isinstance(node, nodes.Macro):
                unsure.add(node.name)

    def name_fixed(n: str, seen: frozenset[str]) -> bool:
        if n in row_names or n in _RUNTIME_NAMES or n in unsure or n in env.globals or n in seen:
            return False
        return all(reads_fixed(e, seen | {n}) for e in assigned.get(n, ()))

    def reads_fixed(node: nodes.Node, seen: frozenset[str]) -> bool:
        # every name the node reads, local or not (a local is computed from names read here too)
        if any(f.name == "random" for f in node.find_all(nodes.Filter)):
            return False
        names = [node] if isinstance(node, nodes.Name) else list(node.find_all(nodes.Name))
        return all(name_fixed(x.name, seen) for x in names if x.ctx == "load")

    effective: dict[str, nodes.Block] = {}
    for tree in chain:
        for block in tree.find_all(nodes.Block):
            effective.setdefault(block.name, block)
    fixed = set()
    for block_name, block in effective.items():
        if block.scoped or any(True for _ in block.find_all(nodes.Block)):
            continue
        if reads_fixed(nodes.Template(block.body, lineno=block.lineno), frozenset()):
            fixed.add(block_name)
    return frozenset(fixed)
