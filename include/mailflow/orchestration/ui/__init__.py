"""Airflow UI extras of mailflow: the live campaign progress page (see :mod:`mailflow.ui.progress`)."""
