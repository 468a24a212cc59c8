"""`raymuter batch INPUT OUTPUT`: a batch file (or a table) through engine actors on Ray Data.

Ray Data reads the input, map_batches sends its lines through `--replicas` BatchWorkers (each a
decoder with `--slots` rows, and its encoder where the model has one), and the driver appends
each answered line to OUTPUT as it comes, so a run killed midway keeps what it finished: run again,
the lines whose custom_id is in OUTPUT already are skipped. A local Ray by default; `--address`
joins a cluster (INPUT must then be readable from every node: shared storage, or a URI Arrow reads).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from .requests import answered_ids, custom_id_of, table_line

TABLES = (".parquet", ".pq")


def run_batch(input_path: str, output_path: str, config: dict, replicas: int = 1, cpus: float | None = None,
              address: str | None = None, table: dict | None = None, progress: bool = True,
              batch_size: int | None = None) -> dict:
    """Run the batch (see the module docstring); returns {done, errors, skipped, seconds}."""
    import ray
    import ray.data

    from .worker import BatchWorker

    output = Path(output_path)
    done_ids = answered_ids(output)
    started = time.monotonic()
    cpus = cpus or max(1.0, (os.cpu_count() or 1) / replicas)
    if not ray.is_initialized():  # the engine actors' CPUs, and one for reading and writing the lines
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                 **({} if address else {"num_cpus": replicas * cpus + 1}))
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the progress line below says it in rows
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    lines = _lines(input_path, config, table)
    total = lines.count() if progress else None
    pending = lines.filter(lambda row: custom_id_of(row["line"]) not in done_ids) if done_ids else lines
    slots = config.get("slots") or 8
    answered = pending.map_batches(BatchWorker, fn_constructor_kwargs={"config": config},
                                   compute=ray.data.ActorPoolStrategy(size=replicas), batch_size=batch_size or slots,
                                   num_cpus=cpus, batch_format="numpy")
    counts = {"done": 0, "errors": 0, "skipped": len(done_ids), "seconds": 0.0}
    last = 0.0
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a") as out:
        for batch in answered.iter_batches(batch_size=None, batch_format="numpy"):
            for text, ok in zip(batch["output"], batch["ok"]):
                out.write(str(text) + "\n")
                counts["done"] += 1
                counts["errors"] += not ok
            out.flush()
            if progress and time.monotonic() - last >= 1:
                last = time.monotonic()
                _progress(counts, total, started)
    counts["seconds"] = time.monotonic() - started
    if progress:
        _progress(counts, total, started, end="\n")
    return counts


def _lines(input_path: str, config: dict, table: dict | None):
    """The input as a Dataset of {line}: a batch file's lines, or a table's rows as lines (a
    table is read here, so each row keeps its number: custom_id row-N)."""
    import pyarrow as pa
    import ray.data

    if table is None:
        if input_path.endswith(TABLES):
            raise ValueError(f"{input_path}: a table needs --prompt-column or --messages-column")
        data = ray.data.read_text(input_path).filter(lambda row: bool(row["text"].strip()))
        return data.map_batches(_as_line, batch_format="numpy")
    if input_path.endswith(TABLES):
        import pyarrow.parquet as pq

        rows = pq.read_table(input_path)
    else:
        import pyarrow.json as pj

        rows = pj.read_json(input_path)
    for column in (table["prompt_column"], table["messages_column"], table["id_column"]):
        if column and column not in rows.column_names:
            raise ValueError(f"{input_path}: no column '{column}' (it has {', '.join(rows.column_names)})")
    rows = rows.append_column("__row", pa.array(range(rows.num_rows), pa.int64()))
    from ..app import served_name

    model = served_name(config.get("model"), config.get("name"))

    def as_lines(batch: dict) -> dict:
        numbers = batch.pop("__row")
        cells = [dict(zip(batch, values)) for values in zip(*batch.values())]
        return {"line": [table_line(row, int(n), model, table["prompt_column"], table["messages_column"],
                                    table["id_column"], table["body"]) for n, row in zip(numbers, cells)]}

    return ray.data.from_arrow(rows).map_batches(as_lines, batch_format="numpy")


def _as_line(batch: dict) -> dict:
    return {"line": batch["text"]}


def _progress(counts: dict, total: int | None, started: float, end: str = "\r") -> None:
    elapsed = max(time.monotonic() - started, 1e-9)
    rate = counts["done"] / elapsed
    left = None if total is None else max(0, total - counts["skipped"] - counts["done"])
    eta = "" if left is None or rate == 0 else f", ETA {left / rate:,.0f} s"
    of = "" if total is None else f"/{total - counts['skipped']}"
    print(f"[raymuter] batch: {counts['done']}{of} lines ({rate:.1f}/s{eta}), {counts['errors']} not 200",
          end=end, file=sys.stderr, flush=True)
