"""`specdec batch --ray`: the same job, its generation spread over a Ray cluster.

The driver (the process running `specdec batch`) keeps everything that makes the job safe: reading and
validating the input (bad lines to the errors file with their line numbers), the resume check (ids already in
the output are never sent), the output's lock and every write to it. The cluster only generates: Ray Data
`map_batches` over the pending lines with a callable class, one actor per worker slot, each loading the bundle
once and running the same `Generator` as a local run; actors return rows, the driver appends them as they
arrive. So the output lines are those of a local run (finishing order aside), and a killed Ray run resumes,
with or without Ray, like a local one: only the rows in flight are redone.

The pending lines are shipped from the driver (`ray.data.from_items`) rather than read by Ray from the JSONL
path: the validation, duplicate and resume checks need the whole file in one place anyway, and then the input
need not be on a filesystem every node sees. The bundle must be: every worker loads it from the same path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pickle
import re
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from specdec.batch import EngineSpec, Generator, Request, Result
from specdec.errors import SpecdecError

RAY_HINT = "pip install 'specdec[ray]'"
# Input rows per map_batches call, in units of the engine's batch size. One call is the unit that is redone
# after a kill (its rows come back together) and the unit of load balancing between workers; within a call
# the batched engine refills finished rows from the rest of the call, so a few batches' worth keeps its rows
# busy while the last, longest requests of the call finish.
CALL_BATCHES = 4
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the remote tracebacks in its messages


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide to run. Workers: one per slot, i.e. the cluster's CPUs divided by the CPUs each
    worker takes (--threads, default 1), or one per GPU on a GPU provider."""

    address: str | None = None  # ray.init's: None = $RAY_ADDRESS or a new local cluster; "auto" = the running one
    workers: int | None = None  # None = one per slot of the cluster
    rows_per_call: int | None = None  # input rows per map_batches call; None = CALL_BATCHES x the batch size

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.rows_per_call is not None and self.rows_per_call < 1:
            raise ValueError(f"rows_per_call must be >= 1, got {self.rows_per_call}")

    def results(self, spec: EngineSpec, pending: list[Request]) -> Iterator[tuple[Request, Result]]:
        """BatchJob's Runner: the pending requests generated on this cluster."""
        return ray_results(spec, pending, self)


@dataclass(frozen=True)
class WorkerPlan:
    """The resources of one worker and how many there are."""

    workers: int
    num_cpus: int
    num_gpus: int
    rows_per_call: int
    calls: int


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401  (the `data` extra: pyarrow, pandas)
    except ImportError as e:
        raise SpecdecError(f"--ray needs Ray Data, which is not installed ({e.name or e})", RAY_HINT) from None
    return ray


def plan_workers(spec: EngineSpec, opts: RayOptions, n_pending: int, cluster: dict[str, float]) -> WorkerPlan:
    """Workers and their resources from the cluster's (ray.cluster_resources()) and the runtime options."""
    # ORT sizes one global thread pool per process (see runtime/session.py); each worker is its own process, so its
    # pool is sized to the CPUs Ray reserves for it and workers never oversubscribe a node. --threads 0 ("all
    # cores" locally) means one CPU per worker here: one worker per CPU slot.
    num_cpus = spec.runtime.threads or 1
    on_gpu = spec.runtime.provider != "cpu"
    if on_gpu:
        slots = int(cluster.get("GPU", 0))
        if slots < 1:
            raise SpecdecError(f"provider {spec.runtime.provider} needs GPUs, and the Ray cluster has none",
                               "run on a cluster with GPU nodes, or use the cpu provider")
    else:
        slots = int(cluster.get("CPU", 0)) // num_cpus
        if slots < 1:
            raise SpecdecError(f"the Ray cluster has {cluster.get('CPU', 0):g} CPUs, fewer than the {num_cpus} "
                               f"each worker takes (--threads)", "lower --threads")
    rows = opts.rows_per_call or CALL_BATCHES * spec.batch_size
    calls = math.ceil(n_pending / rows)
    # Every worker loads the bundle (seconds, and the KV memory): start no more than there are calls for.
    workers = max(1, min(opts.workers or slots, calls))
    return WorkerPlan(workers=workers, num_cpus=num_cpus, num_gpus=1 if on_gpu else 0, rows_per_call=rows,
                      calls=calls)


class _Worker:
    """One Ray Data actor: loads the bundle once, then generates for each call's rows.

    Rows carry pickled `Request`s and come back as pickled `Result`s: ids, prompts and settings are of mixed
    JSON types (an id is a string or an integer) that columnar blocks cannot hold as they are.
    """

    def __init__(self, spec: EngineSpec) -> None:
        self.generator = Generator(spec)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        requests = [pickle.loads(b) for b in batch["request"]]
        lines, results = [], []
        for req, result in self.generator.results(requests):
            lines.append(req.line)
            results.append(pickle.dumps(result))
        return {"line": np.asarray(lines, dtype=np.int64), "result": np.asarray(results, dtype=object)}


@contextlib.contextmanager
def _connected(ray: Any, address: str | None) -> Iterator[None]:
    """A Ray session for the job. One that is already up (a test's, a notebook's) is used and left running;
    otherwise this joins `address` (or starts a local cluster) and shuts down when the job ends."""
    if ray.is_initialized():
        yield
        return
    try:
        # include_dashboard=False: the dashboard's extra processes and port are not needed by a batch job.
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"at {address}" if address else "(local)"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecdecError(f"cannot start or reach a Ray cluster {where}: {first}",
                           "check --ray-address, or leave it out to start a local cluster") from None
    try:
        yield
    finally:
        ray.shutdown()


def ray_results(spec: EngineSpec, pending: list[Request], opts: RayOptions) -> Iterator[tuple[Request, Result]]:
    """(request, Result) for every pending request, generated on Ray workers, in the order calls finish."""
    ray = import_ray()
    by_line = {r.line: r for r in pending}
    with _connected(ray, opts.address):
        plan = plan_workers(spec, opts, len(pending), ray.cluster_resources())
        # A worker's engine: its pool sized to its CPUs; on a GPU, device 0 of the ones Ray made visible to it.
        runtime = dataclasses.replace(spec.runtime, threads=plan.num_cpus,
                                      device_id=0 if plan.num_gpus else spec.runtime.device_id)
        worker_spec = dataclasses.replace(spec, runtime=runtime)
        rows = [{"request": pickle.dumps(r)} for r in pending]
        # One block per call, so every call is one block and the blocks spread over the workers.
        ds = ray.data.from_items(rows, override_num_blocks=plan.calls)
        ds = ds.map_batches(_Worker, fn_constructor_kwargs={"spec": worker_spec}, batch_size=plan.rows_per_call,
                            batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=plan.workers),
                            num_cpus=plan.num_cpus, num_gpus=plan.num_gpus or None)
        # The dataset's own copy of Ray Data's settings (not the process-wide one): the CLI draws its own
        # progress bar and summary, so Ray Data's bars and start/finish lines would only garble stderr.
        ds.context.enable_progress_bars = False
        ds.context.print_on_execution_start = False
        try:
            with _quiet_ray_data():
                for row in ds.iter_rows():
                    yield by_line[int(row["line"])], pickle.loads(row["result"])
        except ray.exceptions.RayError as e:
            raise SpecdecError(f"a Ray worker failed: {_worker_error(e)}",
                               "every node needs specdec[ray] installed and the bundle at the same path") from None


@contextlib.contextmanager
def _quiet_ray_data() -> Iterator[None]:
    """Ray Data's INFO lines off while the job runs (its warnings stay: e.g. an actor pool that cannot be
    scheduled), and its one warning that progress bars are off, which we turned off on purpose. The second
    logger's name is Ray-internal: if it changes, that warning merely shows again."""
    loggers = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name, level in loggers.items():
        logging.getLogger(name).setLevel(max(level, logging.getLogger(name).getEffectiveLevel()))
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def _worker_error(e: BaseException) -> str:
    """The worker's own error out of Ray's wrappers: the original exception where Ray keeps it (a failed
    task), else the last line of the remote traceback Ray puts in its message (an actor that died in
    __init__, e.g. a bundle missing or corrupt on that node)."""
    cause = getattr(e, "cause", None)  # RayTaskError's
    if isinstance(cause, BaseException):
        e = cause
    if isinstance(e, SpecdecError) and type(e).__str__ is SpecdecError.__str__:
        return str(e)
    for x in (e, e.__cause__, e.__context__):
        lines = [ln.strip() for ln in _ANSI.sub("", str(x or "")).splitlines() if ln.strip()]
        if lines:
            return lines[-1].removeprefix("specdec.errors.SpecdecError: ")[:300]
    return type(e).__name__
