"""Airflow UI extras of mailflow: the live campaign progress page (see :mod:`mailflow.orchestration.ui.progress`)."""
