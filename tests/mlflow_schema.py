"""A new SQLite MLflow store in seconds less: the schema MLflow builds is built once per test process and copied.

MLflow creates a new store's tables by replaying its ~90 Alembic migrations, 2-5 s on 2 cores, and the suite
opens a fresh `sqlite:///.../mlflow.db` in dozens of tests. `copy_built_schema` swaps MLflow's table
initialisation for one that runs the real one once, into a template file, and then copies that file's pages
into each new SQLite store (SQLite's backup API). What a test's store holds is a copy of what MLflow's own
initialisation wrote: its tables, indexes and Alembic revision, and no experiment (MLflow adds its Default
experiment afterwards, with the new store's own artifact root). Other databases, and every process the
tests start (launchers, `mlflow server`), initialise as MLflow does."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path


def copy_built_schema(folder: Path) -> None:
    """From now on in this process, a new SQLite MLflow store gets the schema built once into `folder`."""
    import mlflow.store.db.utils as db_utils

    build = db_utils._initialize_tables
    template = folder / "schema.db"

    def initialize(engine) -> None:
        target = engine.url.database
        if engine.url.get_backend_name() != "sqlite" or not target or target == ":memory:":
            build(engine)
            return
        if not template.exists():
            built = db_utils.create_sqlalchemy_engine_with_retry(f"sqlite:///{template}")
            try:
                build(built)
            finally:
                built.dispose()
        engine.dispose()  # no pooled connection of the engine holds the file while its pages are replaced
        with closing(sqlite3.connect(template)) as source, closing(sqlite3.connect(target)) as destination:
            source.backup(destination)

    db_utils._initialize_tables = initialize
