"""`raymuter batch INPUT OUTPUT`: a batch file (or a table) through engine actors on Ray Data.

Ray Data reads the input, map_batches sends its lines through `--replicas` BatchWorkers (each a
decoder with `--slots` rows, and its encoder where the model has one), and the driver appends
each answered line to OUTPUT as it comes, so a run killed midway keeps what it finished: run again,
the lines whose custom_id is in OUTPUT already are skipped. It runs on the Ray this process is
connected to: `raymuter batch` (deployments/cli/batch.py) starts a local one of its own, as `raymuter
serve` does, or joins a cluster at `--address` (INPUT must then be readable from every node: shared
storage, or a URI Arrow reads).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

from .requests import answered_ids, custom_id_of, table_line

# A table's file formats, by suffix: read with pyarrow, as Ray Data's read_parquet, read_csv and read_json.
TABLES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json"}


def actor_cpus(replicas: int, cpus: float | None) -> float:
    """An engine actor's Ray CPUs: `cpus`, else the machine's over the actors, at least 1."""
    return cpus or max(1.0, (os.cpu_count() or 1) / replicas)


def ray_cpus(replicas: int, cpus: float | None) -> float:
    """A local Ray's CPUs for the batch: the engine actors', and one for reading and writing the lines."""
    return replicas * actor_cpus(replicas, cpus) + 1


def run_batch(input_path: str, output_path: str, config: dict, replicas: int = 1, cpus: float | None = None,
              table: dict | None = None, progress: bool = True, batch_size: int | None = None) -> dict:
    """Run the batch (see the module docstring); returns {done, errors (not 200), server_errors (the
    server's failures: requests.server_failed), skipped, seconds}."""
    import ray.data

    output = Path(output_path)
    done_ids = answered_ids(output)
    started = time.monotonic()
    cpus = actor_cpus(replicas, cpus)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the progress line below says it in rows
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    lines = _lines(input_path, config, table)
    total = lines.count() if progress else None
    pending = lines.map_batches(_not_in, fn_kwargs={"done_ids": done_ids}, batch_format="pyarrow") if done_ids else lines
    answered = _answered(pending, config, replicas, cpus, batch_size or config.get("slots") or 8)
    counts = {"done": 0, "errors": 0, "server_errors": 0, "skipped": len(done_ids), "seconds": 0.0}
    last = 0.0
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a") as out:
        for batch in answered.iter_batches(batch_size=None, batch_format="numpy"):
            for text, ok, failed in zip(batch["output"], batch["ok"], batch["server_failed"]):
                out.write(str(text) + "\n")
                counts["done"] += 1
                counts["errors"] += not ok
                counts["server_errors"] += bool(failed)
            out.flush()
            if progress and time.monotonic() - last >= 1:
                last = time.monotonic()
                _progress(counts, total, started)
    counts["seconds"] = time.monotonic() - started
    if progress:
        _progress(counts, total, started, end="\n")
    return counts


def _answered(lines, config: dict, replicas: int, cpus: float, batch_size: int):
    """`lines` through `replicas` engine actors (BatchWorker), `cpus` each: {output, ok, server_failed} rows."""
    import ray.data

    from .worker import BatchWorker

    # max_restarts 0: an engine actor that dies ends the run (its answers so far are in OUTPUT: run
    # again to go on). Ray Data's default restarts it and retries its lines for ever (a line that
    # crashes the engine would loop), and Ray logs an error on every run that such a restart may
    # fail (Ray Data passes every actor its arguments in the object store: ray-project/ray#53727).
    # Ray 2.60 has no named parameter for it, and warns that **ray_remote_args go in 2.64.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return lines.map_batches(BatchWorker, fn_constructor_kwargs={"config": config},
                                 compute=ray.data.ActorPoolStrategy(size=replicas), batch_size=batch_size,
                                 num_cpus=cpus, batch_format="numpy", max_restarts=0)


def _lines(input_path: str, config: dict, table: dict | None):
    """The input as a Dataset of {line}: a batch file's lines, or a table's rows as lines (a
    table is read here, so each row keeps its number: custom_id row-N)."""
    import pyarrow as pa
    import ray.data

    kind = table_format(input_path, table)
    if kind is None:
        return ray.data.read_text(input_path).map_batches(_as_line, batch_format="pyarrow")
    rows = read_table(input_path, kind)
    for column in (table["prompt_column"], table["messages_column"], table["id_column"]):
        if column and column not in rows.column_names:
            raise ValueError(f"{input_path}: no column '{column}' (it has {', '.join(rows.column_names)})")
    rows = rows.append_column("__row", pa.array(range(rows.num_rows), pa.int64()))
    from ..config import served_name

    model = served_name(config.get("model"), config.get("name"))

    def as_lines(batch: dict) -> dict:
        numbers = batch.pop("__row")
        cells = [dict(zip(batch, values)) for values in zip(*batch.values())]
        return {"line": [table_line(row, int(n), model, table["prompt_column"], table["messages_column"],
                                    table["id_column"], table["body"]) for n, row in zip(numbers, cells)]}

    return ray.data.from_arrow(rows).map_batches(as_lines, batch_format="numpy")


def table_format(input_path: str, table: dict | None) -> str | None:
    """How INPUT is read: None, as a batch file's lines; else as a table of its suffix's format
    (TABLES). ValueError for a table's file without a column to run or of a format not read."""
    suffix = Path(input_path).suffix.lower()
    kind = TABLES.get(suffix)
    if table is None:
        if kind in ("parquet", "csv"):
            raise ValueError(f"{input_path}: a table needs --prompt-column or --messages-column")
        return None
    if kind is None:
        raise ValueError(f"{input_path}: a table is a .parquet, .csv or .jsonl file (JSON lines), not "
                         f"{suffix or 'a file without a suffix'}")
    return kind


def read_table(input_path: str, kind: str):
    """A table file as an Arrow table, in its format (table_format)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(input_path)
    if kind == "csv":
        import pyarrow.csv as pc

        return pc.read_csv(input_path)
    import pyarrow.json as pj

    return pj.read_json(input_path)


def _as_line(batch):
    """A batch file's lines less the blank ones (a map, not Ray Data's filter of a function, which
    warns on every run that it would rather have an expression)."""
    return _line_table(text for text in batch.column("text").to_pylist() if text.strip())


def _not_in(batch, done_ids: set):
    """The lines whose custom_id OUTPUT does not hold yet (a resumed run's)."""
    return _line_table(line for line in batch.column("line").to_pylist() if custom_id_of(line) not in done_ids)


def _line_table(lines):
    """Arrow's {line} table of `lines` (typed: a batch may keep none)."""
    import pyarrow as pa

    return pa.table({"line": pa.array(list(lines), pa.string())})


def _progress(counts: dict, total: int | None, started: float, end: str = "\r") -> None:
    elapsed = max(time.monotonic() - started, 1e-9)
    rate = counts["done"] / elapsed
    left = None if total is None else max(0, total - counts["skipped"] - counts["done"])
    eta = "" if left is None or rate == 0 else f", ETA {left / rate:,.0f} s"
    of = "" if total is None else f"/{total - counts['skipped']}"
    print(f"[raymuter] batch: {counts['done']}{of} lines ({rate:.1f}/s{eta}), {counts['errors']} not 200",
          end=end, file=sys.stderr, flush=True)
