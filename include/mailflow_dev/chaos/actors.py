"""The killed processes: a sender, dispatcher or reconciler run in a forked child, SIGKILLed at
its planned point (before/after mint or claim, in flight, before apply)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import httpx
import psycopg

from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.clock import Clock, FakeClock, SystemClock
from mailflow.model.outcome import RunContext, SendError
from mailflow.provider.client import ResendClient, RetryPolicy, key_identity
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow_dev.chaos.scenarios import CLIENT_READ_TIMEOUT, INTERVAL, UNEXPECTED, ActorSpec, Plan


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(plan: Plan) -> None:
    """Patch the actor's seams in THIS (forked) process so it dies at ``plan``."""
    from mailflow import reconciler as repair
    from mailflow.sources.scheduled import claiming
    from mailflow.store.send_log import PostgresStore

    state = {"entries": 0, "sends": 0, "armed": False}

    def before(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            if state["entries"] == plan.chunk:
                _die()
            state["entries"] += 1
            return orig(*a, **k)
        return wrapper

    if plan.point == "before_mint":
        PostgresStore.mint_chunk = before(PostgresStore.mint_chunk)  # type: ignore[method-assign]
    elif plan.point == "before_claim":
        claiming.Dispatcher.claim = before(claiming.Dispatcher.claim)  # type: ignore[method-assign]
        repair.reserve_slot = before(repair.reserve_slot)  # the reconciler reserves, then claims
    elif plan.point == "before_apply":
        orig_apply = PostgresStore.apply

        def apply(self: Any, *a: Any, **k: Any) -> Any:
            if state["armed"]:
                _die()
            return orig_apply(self, *a, **k)
        PostgresStore.apply = apply  # type: ignore[method-assign]
    orig_send = ResendClient.send_batch

    def send_batch(self: Any, batch: Any, deadline: float, slot: float | None = None, **kw: Any) -> Any:
        n = state["sends"]
        state["sends"] += 1
        if n == plan.chunk:
            if plan.point in ("after_mint", "after_claim"):
                _die()
            if plan.point == "in_flight":
                threading.Timer(plan.delay, _die).start()
            if plan.point == "before_apply":
                state["armed"] = True
        return orig_send(self, batch, deadline, slot, **kw)
    ResendClient.send_batch = send_batch  # type: ignore[method-assign]


def _renderer() -> Renderer:
    return Renderer(signer_from_secret("chaos-secret-0123456789"), "https://mail.example.com", "https://app.example.com")


class SlowConnection:
    """A psycopg connection whose every statement answers 0-0.5 s late (random, split between the
    way to the server and the way back): a pacer database under load. ``rng`` draws the delays
    (default: the ``random`` module's)."""

    def __init__(self, conn: psycopg.Connection, rng: random.Random | None = None):
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_rng", rng or random.Random())

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        delay = self._rng.uniform(0.0, 0.5)
        before = delay * self._rng.random()
        time.sleep(before)
        cur = self._conn.execute(*args, **kwargs)
        time.sleep(delay - before)
        return cur

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)


def _pacer_connect(spec: ActorSpec) -> Callable[[], psycopg.Connection]:
    if spec.slow_pacer:
        return lambda: cast(psycopg.Connection, SlowConnection(psycopg.connect(spec.dsn)))
    return lambda: psycopg.connect(spec.dsn)


def _client(spec: ActorSpec, clock: Clock) -> ResendClient:
    # Each actor paces on its own account name (as three misconfigured deployments would): only the
    # provider's team-wide limit holds them together.
    pacer = PostgresPacer(_pacer_connect(spec), f"chaos-{spec.actor}",
                          requests_per_second=10 if spec.sim_seconds is None else 500, target_fraction=1.0)
    return ResendClient(spec.base_url, spec.api_key, pacer=pacer, clock=clock,
                        validation="strict" if spec.strict else "permissive",
                        policy=RetryPolicy(max_attempts=3, base=0.05, cap=0.5, max_retry_after=30),
                        timeout=httpx.Timeout(CLIENT_READ_TIMEOUT, connect=1.0, write=1.0, pool=1.0))


def run_actor(spec: ActorSpec) -> None:
    """One run of one actor (sender, dispatcher or reconciler) against ``spec.dsn``."""
    from mailflow.reconciler import reconcile
    from mailflow.sources import scheduled
    from mailflow.sources.lifecycle import run_lifecycle
    from mailflow.store.send_log import PostgresStore

    clock: Clock = SystemClock() if spec.sim_seconds is None else FakeClock(start=spec.sim_seconds)
    run = RunContext(dag_id=f"chaos_{spec.actor}", run_id=spec.run_id, task_id=spec.actor)
    budget = 20.0 if spec.sim_seconds is None else 240.0
    with psycopg.connect(spec.dsn) as conn, _client(spec, clock) as client:
        if spec.actor == "sender":
            run_lifecycle(PostgresStore(conn), client, _renderer(), spec.campaigns, INTERVAL, run=run,
                          chunk_size=spec.chunk_size, budget_seconds=budget, clock=clock)
        elif spec.actor == "dispatcher":
            scheduled.dispatch(conn, client, _renderer(), budget_seconds=budget, coalesce_seconds=0,
                               poll_seconds=30, batch_size=spec.chunk_size, clock=clock, run=run)
        else:
            conn.autocommit = True
            row = conn.execute("select now()").fetchone()
            assert row is not None
            built: list[ResendClient] = []

            def previous_client(key: str) -> Callable[[], ResendClient]:
                def build() -> ResendClient:  # the hook's previous_api_keys: same account and pacing
                    built.append(_client(dataclasses.replace(spec, api_key=key), clock))
                    return built[-1]
                return build

            try:
                reconcile(conn, client, now=row[0], stale_after=timedelta(0), run=run, clock=clock,
                          deadline=clock.monotonic() + budget,
                          previous={key_identity(k): previous_client(k) for k in spec.previous_keys})
            finally:
                for c in built:
                    c.pacer.close()  # type: ignore[attr-defined]
                    c.close()
        client.pacer.close()  # type: ignore[attr-defined]


def _child(spec: ActorSpec, plan: Plan | None) -> None:
    import logging

    logging.disable(logging.CRITICAL)
    if plan is not None:
        _install_kill(plan)
    try:
        run_actor(spec)
    except SendError:
        os._exit(3)  # a run that stopped with an alert (auth, quota, refused body): recorded, expected
    except BaseException:
        with open(spec.error_log, "a", encoding="utf-8") as fh:
            fh.write(f"--- {spec.actor} {spec.run_id} plan={plan}\n{traceback.format_exc()}\n")
        os._exit(UNEXPECTED)
    os._exit(0)


def fork_actor(spec: ActorSpec, plan: Plan | None, timeout: float = 120.0) -> int:
    """Run ``spec`` in a forked process; return its exit code (``-SIGKILL`` when killed)."""
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(spec, plan))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        with open(spec.error_log, "a", encoding="utf-8") as fh:
            fh.write(f"--- {spec.actor} {spec.run_id} plan={plan}: hung for {timeout} s, killed\n")
        return UNEXPECTED
    return int(proc.exitcode or 0)
