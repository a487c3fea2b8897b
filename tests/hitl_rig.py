"""Answering an Airflow Required Action (human-in-the-loop) from a test, as a person does through the
UI or the REST API, while ``dag.test()`` waits for it: shared by the Airflow-tier tests of
``provision_campaign``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class Responder(threading.Thread):
    """Answer the first Required Action of ``dag_id``/``task_id`` the way the REST API's
    ``PATCH .../hitlDetails`` does (record the response, resume the parked task), or, with
    ``expire``, let it time out and run the scheduler's own timeout sweep. Keeps the request's
    subject and body for the test."""

    def __init__(self, dag_id: str, task_id: str, option: str | None, *, expire: bool = False,
                 before_answer: Callable[[], None] | None = None) -> None:
        super().__init__(daemon=True)
        self.dag_id, self.task_id, self.option, self.expire = dag_id, task_id, option, expire
        self.before_answer = before_answer
        self.body: str | None = None
        self.subject: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._answer()
        except BaseException as exc:  # reported by the test; the waiting run is failed so dag.test() ends
            self.error = exc
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from airflow.utils.state import TaskInstanceState
        from sqlalchemy import update

        with create_session() as session:
            session.execute(update(TaskInstance).where(
                TaskInstance.dag_id == self.dag_id, TaskInstance.state == TaskInstanceState.AWAITING_INPUT,
            ).values(state=TaskInstanceState.FAILED))

    def _answer(self) -> None:
        from airflow.models.hitl import HITLDetail
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.trigger import handle_event_submit
        from airflow.sdk import timezone
        from airflow.triggers.base import TriggerEvent
        from airflow.utils.session import create_session
        from airflow.utils.state import TaskInstanceState
        from sqlalchemy import select

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.3)
            with create_session() as session:
                ti = session.scalar(select(TaskInstance).where(
                    TaskInstance.dag_id == self.dag_id, TaskInstance.task_id == self.task_id,
                    TaskInstance.state == TaskInstanceState.AWAITING_INPUT))
                if ti is not None:
                    detail = session.scalar(select(HITLDetail).where(HITLDetail.ti_id == ti.id))
                    self.body, self.subject = detail.body, detail.subject
                    if self.expire:
                        break
                    if self.before_answer is not None:  # something happens while the approval waits
                        self.before_answer()
                    detail.responded_by = {"id": "approver", "name": "approver"}
                    detail.responded_at = timezone.utcnow()
                    detail.chosen_options = [self.option]
                    detail.params_input = {}
                    session.add(detail)
                    handle_event_submit(TriggerEvent(detail.as_resume_event_payload()), task_instance=ti,
                                        session=session)
                    return
        else:
            raise TimeoutError(f"{self.dag_id}.{self.task_id} never asked for input")
        # expiry: wait out the response timeout, then the scheduler's sweep applies the defaults
        from airflow.jobs.scheduler_job_runner import SchedulerJobRunner

        runner = SchedulerJobRunner.__new__(SchedulerJobRunner)
        runner._log = None
        while time.monotonic() < deadline:
            with create_session() as session:
                ti = session.scalar(select(TaskInstance).where(
                    TaskInstance.dag_id == self.dag_id, TaskInstance.task_id == self.task_id,
                    TaskInstance.state == TaskInstanceState.AWAITING_INPUT))
                if ti is None:
                    return
                if ti.trigger_timeout is not None and ti.trigger_timeout < timezone.utcnow():
                    runner.check_awaiting_input_timeouts(session=session)
            time.sleep(0.5)
        raise TimeoutError("the approval did not expire")


def run_with_answer(dag: Any, conf: dict[str, Any], option: str | None, *, expire: bool = False,
                    before_answer: Callable[[], None] | None = None) -> tuple[Any, Responder]:
    """Run ``dag.test(run_conf=conf)`` while a :class:`Responder` answers its ``approve`` task with
    ``option`` (or lets it expire); returns the run and the responder (with the request it saw)."""
    responder = Responder(dag.dag_id, "approve", option, expire=expire, before_answer=before_answer)
    responder.start()
    dr = dag.test(run_conf=conf)
    responder.join(timeout=30)
    assert responder.error is None, responder.error
    return dr, responder
