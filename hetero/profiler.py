"""The placement report: what the runtime did, as data, a Chrome/Perfetto trace and a plot."""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from .config import SizeLike, file_path, format_budget, format_size, parse_policy, parse_prefetch, parse_size
from .errors import HeteroConfigError, HeteroStateError
from .policies import Policy, report_name, starting_copy
from .tiers import TIER_ORDER
from .tracker import Access, BlockStats, Move

if TYPE_CHECKING:  # pragma: no cover
    from .simulator import SimResult
    from .wrap import HeteroState


_UNKNOWN = object()  # a Report made without saying what its run's policy started as


class _Snapshot(NamedTuple):
    """A log as it was: its first ``n`` entries (the tracker only appends to a log's list, and
    replaces the list to drop entries)."""

    entries: list
    n: int


class Report:
    """A snapshot of a HeteroModule's placement (taken by ``placement_report()``)."""

    def __init__(self, summary: dict[str, Any], accesses: list[Access], moves: list[Move],
                 usage: list[tuple[float, str, int]], stalls: list[tuple[float, float, str]],
                 events: list[tuple] = (), catalog: Optional[dict[str, tuple[str, int]]] = None,
                 slot_size: int = 4096, prefetch: int = 0, host_slots: Optional[int] = None,
                 policy: Any = _UNKNOWN, nvme_files: Optional[list[int]] = None,
                 computes: list[tuple[str, str, float, float]] = (), log_first_step: int = 0,
                 minimums: Optional[dict[str, int]] = None) -> None:
        # policy: what a replay starts from (a name, or a copy of the run's instance taken before
        # it ran); None where the instance could not be copied; by default the summary's name.
        # minimums: the smallest budgets hetero.wrap accepts for the run's model ("device",
        # "host" without NVMe, "host+nvme" with it), which replays are held to as well.
        # The logs: lists, or snapshots of the lists the run's tracker goes on appending to,
        # copied when first read (a report per step of a long run would otherwise copy every
        # log each time).
        self._summary = summary
        self._minimums = minimums or {}
        self._policy = policy
        logs = {"accesses": accesses, "moves": moves, "usage": usage, "stalls": stalls,
                "computes": computes, "events": events}
        self._logs = {k: v if isinstance(v, _Snapshot) else list(v) for k, v in logs.items()}
        self.log_first_step = log_first_step  # the oldest step the logs hold (wrap's log_steps)
        self.catalog = catalog or {}  # block id -> (kind, bytes)
        self.slot_size = slot_size
        self.prefetch = prefetch
        self.host_slots = host_slots  # the host arena's size limit from the model state
        self.nvme_files = nvme_files  # slots of each swap file

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (and deep-copied) with each log as it was, not the run's whole list."""
        state = dict(self.__dict__)
        state["_logs"] = {name: self._log(name) for name in self._logs}
        return state

    def _log(self, name: str) -> list:
        log = self._logs[name]
        if isinstance(log, _Snapshot):
            log = self._logs[name] = log.entries[:log.n]
        return log

    @property
    def accesses(self) -> list[Access]:
        """The access log (API.md's lines)."""
        return self._log("accesses")

    @property
    def moves(self) -> list[Move]:
        """Transfers that finished: when each ran."""
        return self._log("moves")

    @property
    def usage(self) -> list[tuple[float, str, int]]:
        """(time, tier, bytes used after the change), at each change."""
        return self._log("usage")

    @property
    def stalls(self) -> list[tuple[float, float, str]]:
        """(start, end, block): each wait for a block's data."""
        return self._log("stalls")

    @property
    def computes(self) -> list[tuple[str, str, float, float]]:
        """(unit or "optimizer", phase, start, end)."""
        return self._log("computes")

    @property
    def events(self) -> list[tuple]:
        """Every runtime call, for replay in the simulator."""
        return self._log("events")

    @classmethod
    def from_state(cls, state: "HeteroState") -> "Report":
        rt = state.runtime
        tr = rt.tracker
        steps = max(tr.step - tr.first_step, 1)
        none = BlockStats()
        # Beyond API.md, each block's statistics: the seq of its last access (-1: none yet), and
        # its reuse distance, the difference of seq between two uses of it in a row (smoothed as
        # the hotness policy sees it: half the last distance, half the ones before; None: used once).
        blocks = [{"id": b.id, "kind": b.kind, "bytes": b.nbytes,
                   "tier": rt.top(b) if b.tiers else "none",
                   # accesses per completed step (of those the logs hold): a block's heat
                   "hotness": tr.stats.get(b.id, none).in_logs / steps,
                   "last_access": tr.stats.get(b.id, none).last,
                   "reuse_distance": tr.stats.get(b.id, none).reuse_ewma} for b in rt.blocks()]
        follow = getattr(rt.policy, "follow", [])
        summary = {
            "policy": report_name(rt.policy),
            "steps": tr.step,
            "stall_seconds": tr.stall_seconds,
            # of which waiting for deferred optimizer updates (the rest: for transfers)
            "stall_seconds_optimizer": tr.optimizer_stall_seconds,
            # per step (the first steps record the sequence and warm up; one more entry where
            # work after the last step's end waited)
            "step_stall_seconds": tr.step_stall + [0.0] * (tr.step - len(tr.step_stall)),
            "tiers": {name: t.as_dict() for name, t in rt.tiers.items()},
            "traffic": dict(tr.traffic),
            # the same, per step (as step_stall_seconds: an entry per step, one more where
            # transfers after the last step's end moved bytes)
            "step_traffic": [dict(t) for t in tr.step_traffic] + [
                {d: 0 for d in tr.traffic} for _ in range(tr.step - len(tr.step_traffic))],
            "blocks": blocks,
            "misses": tr.misses,
            "prefetch": {"issued": tr.prefetch_issued, "hits": tr.prefetch_hits},
            # per step, the share of accesses that were the recorded step's next one, in its order
            # (trace policies; a step in another order scores low even where prefetch still hits)
            "trace_follow": [m / n if n else 1.0 for m, n in follow],
            # the oldest step the logs (access log, trace, plot) hold: 0 unless wrap's log_steps
            "log_first_step": tr.first_step,
        }
        catalog = {b.id: (b.kind, b.nbytes) for b in rt.blocks()}
        def snap(log: list) -> _Snapshot:
            return _Snapshot(log, len(log))

        return cls(summary, snap(tr.accesses), snap(tr.moves), snap(tr.usage), snap(tr.stalls),
                   snap(tr.events), catalog, rt.slot_size, rt.prefetch_depth, rt.host_slots,
                   state.policy_start, rt.nvme_files, snap(tr.computes), tr.first_step,
                   state.minimums)

    def capacities(self, **budgets: SizeLike) -> dict[str, int]:
        """This run's tier capacities, with any of ``device=``, ``host=``, ``nvme=`` replaced (sizes
        as ``hetero.wrap``'s budgets take them: HeteroConfigError naming the argument otherwise)."""
        caps = {n: t["capacity"] for n, t in self._summary["tiers"].items()}
        caps.update({k: parse_size(v, k) for k, v in budgets.items() if v is not None})
        for name in ("device", "host"):  # (the host's minimum is higher with an NVMe tier)
            nvme = name == "host" and "nvme" in caps
            least = self._minimums.get("host+nvme" if nvme else name)
            value = budgets.get(name)
            given = value is not None or (name == "host" and budgets.get("nvme") is not None)
            if given and least is not None and caps[name] < least:
                raise HeteroConfigError(
                    f"{name}={caps[name] if value is None else value!r} is below the smallest "
                    f"{name}_budget hetero.wrap accepts for this model{' with an NVMe tier' if nvme else ''} "
                    f"({least} bytes, {format_size(least)}); expected {name}>={least}")
        return caps

    def simulate(self, policy: Any = None, *, device: SizeLike = None, host: SizeLike = None,
                 nvme: SizeLike = None, prefetch: Any = None) -> "SimResult":
        """Replay this run's event log under another policy and/or budgets, without tensors.
        With no arguments the result reproduces the run. Arguments are checked as ``hetero.wrap``
        checks its own (``policy``, budgets as sizes, ``prefetch``; HeteroConfigError). A policy
        instance passed here is replayed from a copy of it as it is now (the run's own live
        policy included: the run goes on unaffected); one that cannot be copied (it holds a
        lock) is used as given, which the live policy of an open model cannot be."""
        from .simulator import replay

        self._check_whole_log()
        own = policy is None or policy == self._summary["policy"]  # (the run's swap failures replay)
        if policy is None:
            policy = self._start()
        elif isinstance(parse_policy(policy), Policy):
            copied = starting_copy(policy)  # (a replay points the policy at its own blocks)
            policy = policy if copied is None else copied
        caps, run = self.capacities(device=device, host=host, nvme=nvme), self.capacities()
        depth = self.prefetch if prefetch is None else parse_prefetch(prefetch)
        own = own and caps == run and depth == self.prefetch
        return replay(self.events, self.catalog, policy, caps, self.slot_size, depth, self.host_slots,
                      self.nvme_files if caps.get("nvme") == run.get("nvme") else None,  # (else: one pool)
                      failures=own)

    def _start(self) -> "str | Policy":
        """What a replay of the run starts from: its policy as the run started (every replay
        starts where the run started)."""
        start = self._summary["policy"] if self._policy is _UNKNOWN else self._policy
        if start is None:
            raise HeteroConfigError(
                f"this run's policy {self._summary['policy']!r} is an instance that could not be "
                "copied for a replay (it holds something deepcopy refuses); pass policy= a fresh "
                "instance to simulate()")
        return copy.deepcopy(start) if isinstance(start, Policy) else start

    def _check_whole_log(self) -> None:
        """A replay (or a bound) needs the event log from the first step."""
        if self.log_first_step:
            raise HeteroStateError(
                f"this run's logs hold steps {self.log_first_step} on only (hetero.wrap's log_steps), "
                "and a replay needs every step from the first; expected a run wrapped with "
                "log_steps=None")

    def belady_bound(self, device: SizeLike = None) -> int:
        """Belady's minimum of bytes fetched onto the device for this run's accesses (``device``:
        another device budget, a size as ``simulate`` takes it)."""
        from .simulator import belady_bound

        self._check_whole_log()
        return belady_bound(self.events, self.catalog, self.capacities(device=device)["device"])

    def coresident_bound(self, device: SizeLike = None) -> int:
        """Belady's minimum for this run's accesses with the constraints every placement obeys
        (an acquire's blocks are on the device together; data starts on the device only where
        it is created): tighter than :meth:`belady_bound`, still a lower bound (``device`` as
        there)."""
        from .simulator import coresident_bound

        self._check_whole_log()
        return coresident_bound(self.events, self.catalog, self.capacities(device=device)["device"])

    def save_event_log(self, path: str) -> None:
        """JSON Lines of every runtime call (create / acquire / release / discard / end_step),
        preceded by one header line with the catalog, slot size, capacities and the number of
        events (so that a truncated copy is refused): the input of
        ``hetero.simulator.load_event_log``."""
        path = file_path("save_event_log", path)
        self._check_whole_log()
        with open(path, "w") as f:
            f.write(json.dumps({"catalog": self.catalog, "slot_size": self.slot_size,
                                "capacities": self.capacities(), "prefetch": self.prefetch,
                                "policy": self._summary["policy"], "host_slots": self.host_slots,
                                "nvme_files": self.nvme_files, "events": len(self.events)}) + "\n")
            for ev in self.events:
                f.write(json.dumps(ev) + "\n")

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-serializable data (a deep copy): API.md's keys (policy, steps,
        stall_seconds, tiers, traffic, blocks) and README's additions (per-step lists, prefetch
        counters, the run's budgets and minimums)."""
        return {k: _copied(v) for k, v in self._summary.items()}

    def __str__(self) -> str:
        d = self._summary
        lines = [f"hetero placement report: policy={d['policy']} steps={d['steps']} "
                 f"stall={d['stall_seconds']:.3f}s (optimizer {d['stall_seconds_optimizer']:.3f}s)"]
        for name in TIER_ORDER:
            if name in d["tiers"]:
                t = d["tiers"][name]
                lines.append(f"  {name:6s} capacity {format_budget(t['capacity']):>11s}  used "
                             f"{format_size(t['used']):>11s}  peak {format_size(t['peak']):>11s}")
        lines.append("  traffic: " + ", ".join(f"{k} {format_size(v)}" for k, v in d["traffic"].items()))
        by_tier: dict[str, int] = {}
        for b in d["blocks"]:
            by_tier[b["tier"]] = by_tier.get(b["tier"], 0) + 1
        lines.append(f"  blocks: {len(d['blocks'])} (" + ", ".join(f"{n} on {t}" for t, n in by_tier.items()) + ")")
        return "\n".join(lines)

    def save_access_log(self, path: str) -> None:
        """JSON Lines, one access per line: step, seq, block, bytes, tier (API.md's fields), and
        group (the accesses of one acquire share it) and write."""
        with open(file_path("save_access_log", path), "w") as f:
            for a in self.accesses:
                f.write(json.dumps(a.as_dict()) + "\n")

    def to_chrome_trace(self, path: str) -> None:
        """Chrome/Perfetto trace (JSON, microseconds): compute (each wrapped unit's forward,
        backward and activation-checkpointing recompute, nested as the units are, and the
        optimizer's steps), stalls (waits for a block), moves (tracks per direction, as many as
        its transfers overlap: spans on one track never overlap) and the bytes used per tier as
        counters."""
        path = file_path("to_chrome_trace", path)
        compute, stall = 1, 2
        tids = {"compute": compute, "stalls": stall}
        events: list[dict[str, Any]] = []

        def span(name: str, cat: str, tid: int, start: float, end: float, **args: Any) -> None:
            events.append({"name": name, "cat": cat, "ph": "X", "pid": 1, "tid": tid, "ts": start * 1e6,
                           "dur": max((end - start) * 1e6, 0.001), **({"args": args} if args else {})})

        for what, phase, start, end in self.computes:
            span(f"{phase} {what or '(root)'}", "compute", compute, start, end, unit=what, phase=phase)
        for start, end, block in self.stalls:
            span(f"stall {block}", "stall", stall, start, end, block=block)
        lanes: dict[str, list[float]] = {}  # per direction, when each of its tracks is free again
        for m in sorted(self.moves, key=lambda m: m.start):
            # Transfers of one direction overlap in time, and spans on one track must nest:
            # each goes on the first track of its direction that is free by its start.
            direction = f"{m.src}->{m.dst}"
            ends = lanes.setdefault(direction, [])
            lane = next((i for i, end in enumerate(ends) if end <= m.start), len(ends))
            if lane == len(ends):
                ends.append(m.end)
            ends[lane] = m.end
            name = direction if lane == 0 else f"{direction} #{lane + 1}"
            span(m.block, "move", tids.setdefault(name, len(tids) + 1), m.start, m.end,
                 bytes=m.bytes, direction=direction, prefetch=m.prefetch)
        for t, tier, used in self.usage:
            events.append({"name": f"{tier} bytes", "cat": "usage", "ph": "C", "pid": 1, "ts": t * 1e6,
                           "args": {"used": used}})
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "hetero"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
                 for name, tid in tids.items()]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)

    def plot(self, path: str) -> None:
        """PNG of bytes used per tier over time (budgets dashed), with moves marked as ticks on
        the time axis and stalls as red spans along it. Written at ``path`` exactly (whatever its
        suffix); drawn without pyplot, so the program's matplotlib backend is left as it was."""
        path = file_path("plot", path)
        from matplotlib.figure import Figure

        fig = Figure(figsize=(11, 4))
        ax = fig.subplots()
        caps = [t["capacity"] for t in self._summary["tiers"].values()]
        peak = max([u for _, _, u in self.usage] + [1])
        top = min(max(caps), peak * 1.5) / 2**20
        for name, tier in self._summary["tiers"].items():
            pts = [(t, u) for t, n, u in self.usage if n == name]
            if pts:
                xs, ys = zip(*pts)
                cap = tier["capacity"] / 2**20
                line, = ax.step(xs, [y / 2**20 for y in ys], where="post",
                                label=f"{name} used (budget {format_budget(tier['capacity'])})")
                if cap <= top:  # (a budget far above the peak would flatten the curves: not drawn)
                    ax.axhline(cap, color=line.get_color(), ls="--", lw=0.8, label=f"{name} budget")
        if self.moves:
            ax.plot([m.start for m in self.moves], [0] * len(self.moves), "|", color="k", ms=8,
                    label="moves")
        if self.stalls:  # a band along the bottom, red where compute waited
            ax.broken_barh([(s, e - s) for s, e, _ in self.stalls], (0, top * 0.04), color="tab:red",
                           label="stalls")
        ax.set_ylim(0, top)
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_title(f"hetero placement ({self._summary['policy']}, {self._summary['steps']} steps)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # (beside the data)
        fig.tight_layout()
        with open(path, "wb") as f:
            fig.savefig(f, format="png", dpi=100)


def _copied(value: Any) -> Any:
    """A copy of a summary value (JSON data: dicts and lists nest two deep at most), deep enough
    that the caller may change it freely; faster than a JSON round trip over a long run's
    per-step lists."""
    if isinstance(value, dict):
        return {k: _copied(v) if isinstance(v, (dict, list, tuple)) else v for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copied(v) if isinstance(v, (dict, list, tuple)) else v for v in value]
    return value
