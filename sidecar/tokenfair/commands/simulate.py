"""``tokenfair simulate``: replay a scenario or a recorded trace under policies, side by side."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tokenfair.commands import add_format_flag, progress, simulate_pool
from tokenfair.config import Config, apply_overrides, load_tenants_file
from tokenfair.core import (
    DEFAULT_POLICY,
    LESSON_POLICIES,
    POLICIES,
    Decision,
    DuplicateRequestError,
)
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import (
    TraceLine,
    TraceOutOfOrder,
    TraceReading,
    TraceRecord,
    encode_decision,
    iter_trace_lines,
    scan_trace,
    stream_arrivals,
    stream_validated,
)
from tokenfair.sim.fairness import (
    ArrivalsRead,
    FairnessReport,
    FairnessTally,
    fairness_to_json,
    format_fairness,
)
from tokenfair.sim.fold import fold_decisions
from tokenfair.sim.report import SummaryTally
from tokenfair.sim.scenarios import SCENARIOS
from tokenfair.sim.simulator import Arrival, replay

EXPERIMENT = "multi-tenant-service-token-drr-and-admission-control"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay a workload under one or more policies and compare them",
        description=(
            "Replay a built-in scenario or a recorded trace on a virtual clock (one serial model "
            "server, the lesson's cost model) and report admissions, sheds and TTFT per policy, "
            "then each tenant's served service tokens against its fluid fair-share reference "
            "and its weighted max-min share over the arrival window (docs/report.md). The JSON "
            "report keeps the lesson's 'comparison' block and adds 'fairness' by policy beside "
            "it. A trace whose lines are in (arrival_ms, request_id) order is streamed once per "
            "policy, the first replay validating it as it reads (memory follows the backlog, "
            "not the file); otherwise it is validated, then held sorted in memory "
            "(docs/records.md). Nothing is written (report, --records, --plot) unless the whole "
            "trace is valid."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", choices=sorted(SCENARIOS), help="a built-in workload")
    source.add_argument("--trace", type=Path, help="request records (JSONL); needs --tenants")
    parser.add_argument(
        "--tenants",
        type=Path,
        help="YAML with TenantQuota manifests and/or a SchedulingPolicy or a TokenfairConfig: "
        "the sidecar's own config file as it is (its sidecar: section is ignored)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=sorted(POLICIES),
        help="policy to run (repeatable; default: "
        f"{', '.join([*LESSON_POLICIES, DEFAULT_POLICY])})",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a policy parameter (maxBatchWaitMs=5000) or tenant field "
        "(tenants.tenant_batch_rag.weight=2); repeatable",
    )
    parser.add_argument("--records", type=Path, help="write every decision record here (JSONL)")
    add_format_flag(parser)
    parser.add_argument(
        "--plot",
        type=Path,
        help="write a PNG of TTFT, admitted and refused service and served vs fluid reference "
        "and windowed share per tenant, one column per policy",
    )
    progress.add_flag(parser)
    scaling = parser.add_argument_group(
        "autoscaling (docs/observability.md: tuning the autoscaler offline)"
    )
    scaling.add_argument(
        "--autoscale",
        metavar="MIN:MAX",
        help="replay against a replica count that follows the scaling signal (tokenfair_"
        "demand_ratio) within MIN..MAX, and against fixed counts from MIN up to the first that "
        "meets the interactive SLO; report replica-seconds and SLO misses of each (one policy)",
    )
    scaling.add_argument(
        "--scale-target", type=float, default=0.8,
        help="the signal each replica should run at (default 0.8)",
    )  # fmt: skip
    scaling.add_argument(
        "--scale-interval-ms", type=float, default=1000.0,
        help="how often the autoscaler reads the signal (default 1000)",
    )  # fmt: skip
    scaling.add_argument(
        "--scale-up-delay-ms", type=float, default=0.0,
        help="a new replica's start-up time (default 0)",
    )  # fmt: skip
    scaling.add_argument(
        "--scale-down-window-ms", type=float, default=5000.0,
        help="scale down only to the largest count wished for over this window (default 5000)",
    )  # fmt: skip
    scaling.add_argument(
        "--slo-ttft-ms", type=float, default=None,
        help="interactive TTFT SLO (default: the policy's maxInteractiveWaitMs)",
    )  # fmt: skip
    scaling.add_argument(
        "--slo-miss-budget", type=float, default=0.01,
        help="fraction of interactive requests that may miss (refused for capacity, or TTFT "
        "over the SLO) in a run that meets the SLO (default 0.01)",
    )  # fmt: skip
    simulate_pool.add_arguments(parser)
    parser.set_defaults(func=run)


Window = tuple[float, float | None]
"""The fairness window known before a replay: ``(min arrival, max arrival)``, or ``(t, None)``
when every request arrives at ``t`` (see ``FairnessTally``)."""


def _window(first_arrival_ms: float, last_arrival_ms: float) -> Window:
    if last_arrival_ms > first_arrival_ms:
        return (first_arrival_ms, last_arrival_ms)
    return (first_arrival_ms, None)


def _arrival(cost: CostModel, record: TraceRecord) -> Arrival:
    """A trace record as the replay takes it: its recorded usage priced by ``cost``."""
    used = record.actual_tokens()
    if used is None:
        return (record.request, None, None)
    return (record.request, cost.service_tokens(*used), cost.kv_blocks(*used))


def _in_memory(
    arrivals: list[Arrival],
) -> tuple[Callable[[], Iterable[Arrival]], Window, int]:
    arrivals.sort(key=lambda a: (a[0].arrival_ms, a[0].request_id))
    times = [a[0].arrival_ms for a in arrivals]
    return (lambda: arrivals), _window(min(times), max(times)), len(arrivals)


class _Trace:
    """A trace file, replayed once per policy.

    * In order (``(arrival_ms, request_id)``, the usual case): the first replay reads the file
      through :func:`stream_validated`, which validates each line as it goes (no separate
      scan: one read of the file fewer) and tells the fairness tally the window as it grows;
      the later replays stream the validated file (:func:`stream_arrivals`, or priced lines
      when it records usage).
    * Out of order: the first replay stops at the first line out of order
      (``TraceOutOfOrder``), the caller drops what it tallied, :meth:`hold_sorted` validates the
      whole file and holds it sorted, and every replay runs over that list.
    * ``validate_first``: :func:`scan_trace` validates the whole file before any replay (for a
      ``--records`` target that cannot be rewritten, such as a pipe, and for a progress bar,
      which needs the number of requests).
    """

    def __init__(self, path: Path, config: Config, *, validate_first: bool) -> None:
        self.path = path
        self.config = config
        self._cost = CostModel.from_policy(config.policy)
        self._reading: TraceReading | None = None
        self._sorted: tuple[Callable[[], Iterable[Arrival]], Window, int] | None = None
        if validate_first:
            self.validate()

    @property
    def count(self) -> int | None:
        """The number of requests, once the file has been read through (else None)."""
        if self._sorted is not None:
            return self._sorted[2]
        if self._reading is not None and self._reading.complete:
            return self._reading.records
        return None

    def _priced(self, line: TraceLine) -> Arrival:
        return _arrival(self._cost, TraceRecord.from_line(line))

    def arrivals(self) -> tuple[Iterable[Arrival], Window | ArrivalsRead]:
        """The next replay's arrivals and its fairness window (the reading itself, while the
        first replay reads the file)."""
        if self._sorted is not None:
            arrivals, window, _ = self._sorted
            return arrivals(), window
        reading = self._reading
        if reading is None or not reading.complete:
            # First replay, or one that stopped (the records and tallies of a stopped one are
            # dropped): read and validate as it goes.
            reading = self._reading = TraceReading()
            known = self.config.tenant_index
            return stream_validated(self.path, known, reading, self._priced), reading
        window = _window(reading.first_arrival_ms, reading.last_arrival_ms)
        if reading.observed_usage:
            lines = map(TraceRecord.from_line, iter_trace_lines(self.path, unique_ids=False))
            return (_arrival(self._cost, r) for r in lines), window
        return stream_arrivals(self.path), window

    def validate(self) -> None:
        """Validate the whole file now (:func:`scan_trace`: the error of its first broken rule),
        unless it has been; then the replays stream the validated file, or the sorted list
        when its lines are out of order (no replay reads an unvalidated line)."""
        if self._sorted is not None or (self._reading is not None and self._reading.complete):
            return
        scan = scan_trace(self.path, known_tenants=self.config.tenant_index)
        if not scan.in_order:
            self.hold_sorted()
        else:
            self._reading = TraceReading(
                scan.records, scan.first_arrival_ms, scan.last_arrival_ms,
                scan.observed_usage, complete=True,
            )  # fmt: skip

    def hold_sorted(self) -> None:
        """Validate the whole file and hold it sorted (a trace whose lines are not in order)."""
        records = map(TraceRecord.from_line, iter_trace_lines(self.path, self.config.tenant_index))
        self._sorted = _in_memory([_arrival(self._cost, r) for r in records])


def _replaceable(path: Path) -> bool:
    """Whether ``--records`` may be written aside and renamed over ``path``: it does not exist
    yet (in a folder this process may write), or it is a regular file (not a link) with one
    name, owned by this user, that this process may write, in such a folder. Anything else (a
    link, ``/dev/stdout``, a pipe, a hard-linked or someone else's file) is written in place,
    as ``open(path, "wb")`` would: the rename would replace the link or the name, not write
    where it points."""
    folder = path.parent
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return os.access(folder, os.W_OK)
    except OSError:
        return False  # the open in place says why, as it always did
    return (
        stat.S_ISREG(status.st_mode)
        and status.st_nlink == 1
        and status.st_uid == os.geteuid()
        and os.access(path, os.W_OK)
        and os.access(folder, os.W_OK)
    )


class _RecordsFile:
    """``--records FILE``. Written aside when :func:`_replaceable` (``rewritable``):
    ``.tokenfair-records.<pid>.<random>.tmp`` in ``FILE``'s folder, with ``FILE``'s permissions
    when it exists, renamed over ``FILE`` when every replay has finished (:meth:`commit`),
    removed otherwise (:meth:`discard`), so a bad line found mid-trace leaves ``FILE`` as it was.
    Otherwise (or when no file aside can be created) written in place, and the trace is
    validated before ``FILE`` is opened. Opened before the replays (a bad path costs no
    replay)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rewritable = _replaceable(path)
        self._aside: Path | None = None
        self._handle: BinaryIO | None = None

    @property
    def handle(self) -> BinaryIO:
        assert self._handle is not None, "open() first"
        return self._handle

    def open_aside(self) -> bool:
        """Open the file aside when ``rewritable`` and it can be created (its name is new:
        ``O_EXCL``, and never a link: ``O_NOFOLLOW``); whether it was. When it was not,
        ``rewritable`` is false and :meth:`open_in_place` is next."""
        if not self.rewritable:
            return False
        aside = self.path.parent / f".tokenfair-records.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            descriptor = os.open(aside, flags, 0o666)  # the umask applies, as to open("wb")
        except OSError:
            self.rewritable = False  # e.g. a folder that refuses new names: in place
            return False
        self._aside = aside
        self._handle = os.fdopen(descriptor, "wb")
        try:
            os.fchmod(descriptor, stat.S_IMODE(os.stat(self.path).st_mode))
        except FileNotFoundError:
            pass  # a new file: the umask's permissions, as open("wb") gives
        except OSError as exc:
            self.discard()
            raise ValueError(f"--records {self.path}: cannot write ({exc.strerror})") from None
        return True

    def open_in_place(self) -> None:
        """Open ``FILE`` itself (truncated); ``ValueError`` naming it if it cannot be."""
        try:
            self._handle = self.path.open("wb")
        except OSError as exc:
            raise ValueError(f"--records {self.path}: cannot write ({exc.strerror})") from None

    def restart(self) -> None:
        """Drop what was written (a replay that stopped at a line out of order)."""
        assert self.rewritable, "only a rewritable target restarts"
        self.handle.seek(0)
        self.handle.truncate()

    def commit(self) -> None:
        if self._handle is not None:
            self._handle.close()
        if self._aside is not None:
            os.replace(self._aside, self.path)
            self._aside = None

    def discard(self) -> None:
        """Close without keeping: the file aside is removed, even when closing fails (a full
        disk refuses the last buffered bytes)."""
        try:
            if self._handle is not None:
                self._handle.close()
        except OSError:
            pass  # the records are dropped anyway; the error that brought us here is reported
        finally:
            if self._aside is not None:
                self._aside.unlink(missing_ok=True)
                self._aside = None


def _replay_policy(
    config: Config,
    arrivals: Iterable[Arrival],
    policy: str,
    window: Window | ArrivalsRead,
    records: BinaryIO | None,
    kept: list[Decision] | None,
    bar: progress.Bar | None = None,
) -> tuple[dict[str, Any], FairnessReport]:
    """One policy's replay, folded as it goes: its summary, its fairness; each decision written
    to ``records`` and appended to ``kept`` when given, else dropped once counted. A shown
    ``bar`` counts the decisions (every ``progress.UPDATE_EVERY``); a hidden one costs nothing."""
    summary = SummaryTally()
    fairness = FairnessTally(config, window)
    decisions: Iterable[tuple[Decision, int | None]] = replay(config, arrivals, policy)
    if bar is not None:
        decisions = bar.iterate(decisions)
    fold(decisions, summary, fairness, records, policy, kept)
    return summary.summary(), fairness.report()


def fold(
    decisions: Iterable[tuple[Decision, int | None]],
    summary: SummaryTally,
    fairness: FairnessTally,
    records: BinaryIO | None = None,
    policy: str | None = None,
    kept: list[Decision] | None = None,
) -> None:
    """``summary.add(decision)`` and ``fairness.add(decision, decision_size(...))`` of each
    ``(decision, recorded usage)`` of a replay (:func:`tokenfair.sim.fold.fold_decisions`);
    each decision written to ``records`` (tagged ``policy``) and appended to ``kept`` when
    given, else dropped once counted."""
    write: Callable[[Decision], object] | None = None
    if records is not None:
        write_bytes = records.write

        def write(decision: Decision) -> object:
            return write_bytes(encode_decision(decision, policy))

    fold_decisions(decisions, summary, fairness, write, None if kept is None else kept.append)


def run(args: argparse.Namespace) -> int:
    if args.autoscale is not None:
        return _autoscale(args)
    simulate_pool.check_arguments(args)
    if args.replicas is not None:
        config, pool_arrivals = _pool_workload(args)
        return simulate_pool.run_pool(args, config, pool_arrivals, args.policy or [DEFAULT_POLICY])
    records = _RecordsFile(args.records) if args.records else None
    committed = False
    try:
        replayed = _run(args, records)
        if records is not None:
            records.commit()  # before the plot: a plot that fails keeps the records
            committed = True
    finally:
        if records is not None and not committed:
            records.discard()
    if replayed.kept is not None:
        from tokenfair.sim.plot import plot_report  # matplotlib is an optional extra

        plot_report(replayed.kept, args.plot, replayed.fairness, title=replayed.title)
    if args.format == "json":
        json.dump(replayed.report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(replayed.comparison, replayed.fairness))
    return 0


@dataclass(frozen=True, slots=True)
class _Replayed:
    """What the replays gave: the JSON report, its parts, and the decisions kept for --plot."""

    report: dict[str, Any]
    comparison: dict[str, dict[str, Any]]
    fairness: dict[str, FairnessReport]
    kept: dict[str, list[Decision]] | None
    title: str


def _run(args: argparse.Namespace, records: _RecordsFile | None) -> _Replayed:
    """Every policy's replay, in order (``records`` written as they go)."""
    trace: _Trace | None = None
    window: Window | ArrivalsRead
    count: int | None
    if args.scenario:
        if args.tenants:
            config = load_tenants_file(args.tenants)
            _, requests = SCENARIOS[args.scenario]()
        else:
            config, requests = SCENARIOS[args.scenario]()
        config = apply_overrides(config, args.overrides)
        arrivals, window, count = _in_memory(_unique([(r, None, None) for r in requests]))
        source = f"--scenario {args.scenario}"
    else:
        if not args.tenants:
            raise ValueError("--trace needs --tenants FILE.yaml (the quotas to replay against)")
        # Recorded usage is priced by the (possibly overridden) policy's cost model.
        config = apply_overrides(load_tenants_file(args.tenants), args.overrides)
        # A shown bar counts against the number of requests: a scan first gives it.
        validate_first = progress.wanted(args) or (records is not None and not records.rewritable)
        trace = _Trace(args.trace, config, validate_first=validate_first)
        source = f"--trace {args.trace.name}"
    if records is not None and not records.open_aside():
        if trace is not None:
            trace.validate()  # (done already unless no file aside could be made) before FILE
            # is truncated: a bad trace is then the error, and FILE is left as it was
        records.open_in_place()
    policies = args.policy or [*LESSON_POLICIES, DEFAULT_POLICY]
    comparison: dict[str, dict[str, Any]] = {}
    fairness: dict[str, FairnessReport] = {}
    # Decisions are kept only for --plot; --records streams them to the file.
    results: dict[str, list[Decision]] | None = {} if args.plot else None
    handle = None if records is None else records.handle
    for number, name in enumerate(policies, start=1):
        label = f"simulate {name} ({number}/{len(policies)})"
        while True:
            if trace is not None:
                replayed, window = trace.arrivals()
                count = trace.count  # None while the first replay reads the file
            else:
                replayed = arrivals()
            kept = None if results is None else results.setdefault(name, [])
            try:
                with progress.bar(args, label, total=count) as bar:
                    comparison[name], fairness[name] = _replay_policy(
                        config, replayed, name, window, handle, kept, bar
                    )
                break
            except TraceOutOfOrder:
                # Only the first replay reads unvalidated lines: nothing is written but its own
                # records (dropped here) before the trace is held sorted.
                assert trace is not None
                if records is not None:
                    records.restart()
                if kept is not None:
                    kept.clear()
                trace.hold_sorted()
            except DuplicateRequestError:
                # A repeated id the first replay met before the end of the file, where the one
                # pass checks them: the error the trace's reader gives for it.
                if trace is not None:
                    trace.validate()
                raise
            finally:
                # A replay that stopped leaves its reader mid-file: close it now (the compiled
                # reader closes its file only when closed, or when it is freed).
                close = getattr(replayed, "close", None)
                if close is not None:
                    close()
    if trace is not None:
        count = trace.count or 0
    report = {
        "experiment": EXPERIMENT,
        "decode_weight": config.policy.decode_weight,
        "comparison": comparison,  # exactly the lesson's shape: nothing of ours inside
        "fairness": {name: fairness_to_json(f) for name, f in fairness.items()},
    }
    title = f"tokenfair simulate {source}: {count} requests"
    return _Replayed(report, comparison, fairness, results, title)


def _autoscale(args: argparse.Namespace) -> int:
    """``--autoscale``: the autoscaled replay and the fixed ones (``sim/autoscale.py``)."""
    from tokenfair.core import make_scheduler
    from tokenfair.records.codec import read_trace
    from tokenfair.sim.autoscale import Autoscaler, Slo, compare

    for flag, given in (
        ("--records", args.records), ("--plot", args.plot), ("--replicas", args.replicas),
    ):  # fmt: skip
        if given is not None:
            raise ValueError(f"{flag}: not with --autoscale (it reports replica-seconds only)")
    bounds = args.autoscale.split(":")
    try:
        low, high = (int(part) for part in bounds)
    except ValueError:
        raise ValueError(
            f"--autoscale: must be MIN:MAX, two integers (got {args.autoscale!r})"
        ) from None
    policies = args.policy or [DEFAULT_POLICY]
    if len(policies) != 1:
        raise ValueError("--autoscale: give one --policy (the replays are per policy)")
    policy = policies[0]
    if args.scenario:
        config, requests = SCENARIOS[args.scenario]()
        if args.tenants:
            config = load_tenants_file(args.tenants)
        source = f"--scenario {args.scenario}"
    else:
        if not args.tenants:
            raise ValueError("--trace needs --tenants FILE.yaml (the quotas to replay against)")
        config = load_tenants_file(args.tenants)
        requests = [record.request for record in read_trace(args.trace, config.tenant_index)]
        source = f"--trace {args.trace.name}"
    config = apply_overrides(config, args.overrides)
    make_scheduler(policy, config)  # the policy's own checks, before any replay
    autoscaler = Autoscaler(low, high, args.scale_target, args.scale_interval_ms,
                            args.scale_up_delay_ms, args.scale_down_window_ms)  # fmt: skip
    slo_ttft_ms = config.policy.max_interactive_wait_ms
    if args.slo_ttft_ms is not None:
        slo_ttft_ms = args.slo_ttft_ms
    if not (slo_ttft_ms > 0 and slo_ttft_ms < float("inf")):
        raise ValueError(f"--slo-ttft-ms: must be a number > 0 (got {slo_ttft_ms})")
    if not 0 <= args.slo_miss_budget < 1:
        raise ValueError(f"--slo-miss-budget: must be in [0, 1) (got {args.slo_miss_budget})")
    slo = Slo(slo_ttft_ms, args.slo_miss_budget)
    scaled, fixed = compare(config, requests, policy, autoscaler, slo)
    runs = [scaled, *fixed]
    cheapest = next((run for run in fixed if run.meets_slo), None)
    report = {
        "source": source,
        "policy": policy,
        "autoscaler": {
            "min_replicas": low, "max_replicas": high, "target": autoscaler.target,
            "interval_ms": autoscaler.interval_ms,
            "scale_up_delay_ms": autoscaler.scale_up_delay_ms,
            "scale_down_window_ms": autoscaler.scale_down_window_ms,
        },
        "slo": {"interactive_ttft_ms": slo.ttft_ms, "miss_budget": slo.miss_budget},
        "runs": [
            {
                "run": run.label, "replica_seconds": round(run.replica_seconds, 3),
                "max_replicas": run.max_replicas,
                "interactive_requests": run.interactive_requests, "misses": run.misses,
                "refused_for_capacity": run.refused_for_capacity,
                "miss_ratio": round(run.miss_ratio, 6), "meets_slo": run.meets_slo,
            }
            for run in runs
        ],
        "replica_changes": [[at_ms, count] for at_ms, count in scaled.replicas],
        "autoscaled_over_fixed_replica_seconds": (
            None if cheapest is None
            else round(scaled.replica_seconds / cheapest.replica_seconds, 4)
        ),
    }  # fmt: skip
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    lines = [
        f"autoscale {policy} ({source}): replicas {low}..{high}, signal target "
        f"{autoscaler.target:g}, read every {autoscaler.interval_ms:g} ms, start-up "
        f"{autoscaler.scale_up_delay_ms:g} ms, scale-down window "
        f"{autoscaler.scale_down_window_ms:g} ms",
        f"  SLO: interactive TTFT <= {slo.ttft_ms:g} ms and not refused for capacity, misses "
        f"<= {slo.miss_budget:.2%}",
        f"  {'run':<12}{'replica-s':>12}{'max n':>7}{'interactive':>13}{'misses':>8}"
        f"{'miss %':>9}{'meets SLO':>11}",
    ]
    for run in runs:
        lines.append(
            f"  {run.label:<12}{run.replica_seconds:>12.2f}{run.max_replicas:>7}"
            f"{run.interactive_requests:>13}{run.misses:>8}{run.miss_ratio:>9.2%}"
            f"{'yes' if run.meets_slo else 'no':>11}"
        )
    changes = ", ".join(f"{count} at {at_ms / 1000:g} s" for at_ms, count in scaled.replicas)
    lines.append(f"  autoscaled replicas: {changes}")
    if cheapest is None:
        lines.append(f"  no fixed count up to {high} meets the SLO")
    else:
        lines.append(
            f"  autoscaled / {cheapest.label} (the smallest fixed count that meets the SLO): "
            f"{scaled.replica_seconds / cheapest.replica_seconds:.3f} of the replica-seconds"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _pool_workload(args: argparse.Namespace) -> tuple[Config, list[Arrival]]:
    """The workload of a pool replay, held sorted in memory (it is routed before it runs)."""
    if args.scenario:
        if args.tenants:
            config = load_tenants_file(args.tenants)
            _, requests = SCENARIOS[args.scenario]()
        else:
            config, requests = SCENARIOS[args.scenario]()
        config = apply_overrides(config, args.overrides)
        arrivals = _unique([(r, None, None) for r in requests])
        arrivals.sort(key=lambda a: (a[0].arrival_ms, a[0].request_id))
        return config, arrivals
    if not args.tenants:
        raise ValueError("--trace needs --tenants FILE.yaml (the quotas to replay against)")
    config = apply_overrides(load_tenants_file(args.tenants), args.overrides)
    trace = _Trace(args.trace, config, validate_first=False)
    trace.hold_sorted()
    held, _ = trace.arrivals()
    return config, list(held)


def _unique(arrivals: list[Arrival]) -> list[Arrival]:
    if len({a[0].request_id for a in arrivals}) != len(arrivals):
        raise ValueError("request ids must be unique within a trace")
    return arrivals


def format_table(
    comparison: dict[str, dict[str, Any]], fairness: Mapping[str, FairnessReport] | None = None
) -> str:
    """A fixed-width table: one block per policy, one row per tenant; with ``fairness`` (by
    policy), its table under each block."""
    lines = []
    for name, summary in comparison.items():
        lines.append(
            f"{name}: admitted {summary['admitted_requests']}/{summary['total_requests']}, "
            f"shed {summary['shed_429_requests']} {summary['shed_reasons'] or ''}".rstrip()
        )
        if "would_refuse_requests" in summary:  # shadow mode: served, but enforcement would not
            lines.append(
                f"  shadow mode: would refuse {summary['would_refuse_requests']} "
                f"{summary['would_refuse_reasons']} (served)"
            )
        peak_kv = summary["peak_kv_occupancy_ratio"]  # None: not measured (a live run)
        lines.append(
            f"  interactive TTFT p50 {summary['interactive_p50_ttft_ms']:.2f} ms, "
            f"p99 {summary['interactive_p99_ttft_ms']:.2f} ms; batch TTFT p99 "
            f"{summary['batch_p99_ttft_ms']:.2f} ms; "
            + (
                "peak admitted KV not measured live"
                if peak_kv is None
                else f"peak admitted KV {peak_kv:.4f}"
            )
        )
        lines.append(
            f"  {'tenant':<22}{'submitted':>10}{'admitted':>10}{'shed':>6}"
            f"{'service tokens':>16}{'p50 TTFT':>11}{'p99 TTFT':>11}"
        )
        for tenant_id, row in summary["tenants"].items():
            lines.append(
                f"  {tenant_id:<22}{row['submitted']:>10}{row['admitted']:>10}{row['shed_429']:>6}"
                f"{row['admitted_service_tokens']:>16}{row['p50_ttft_ms']:>11.2f}"
                f"{row['p99_ttft_ms']:>11.2f}"
            )
        if fairness is not None and name in fairness:
            lines.append(format_fairness(fairness[name]).rstrip("\n"))
        lines.append("")
    return "\n".join(lines)
