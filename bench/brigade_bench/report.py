"""`brigade bench all --report bench/report.md`: every benchmark in one process, one after the other,
each `--repeat` times in a row (`brigade_bench.repeat`), then a Markdown report with the machine, each
benchmark's settings, its figures (median, worst and every run, with the load average before and
after each run), a table of targets (pass / miss, judged on the worst run) and the PNG plots (of
the last run). Each benchmark's flat JSON summary is printed as it finishes; the summaries and every
run's own figures are kept in results.json next to the report. Every ratio in it compares with a
baseline measured in the same run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from brigade_bench.notes import NOTES
from brigade_bench.repeat import (
    PROBES,
    bench_module,
    default_repeat,
    load_text,
    loadavg,
    run_repeated,
    summarize,
)
from brigade_bench.targets import TARGETS, Target

ORDER = ["bucket", "proxy", "create-stall", "learner", "rollout", "fleet", "sync-latency", "preemption", "topology", "scale", "real",
         "real-gen"]


# ---------------------------------------------------------------- judging the targets


@dataclass
class Row:
    bench: str
    what: str
    measured: str
    target: str
    status: str   # pass | miss | n/a
    worst_run: str = ""   # which run was the worst, and the load average around it (with several runs)


def _runs(result: dict | list[dict]) -> list[dict]:
    """A benchmark's runs: [{"result": ..., "load_before": ..., ...}], or one bare result."""
    if isinstance(result, dict):
        return [{"result": result}]
    return result


def _judged(t: Target, r: dict) -> float | None:
    """The run's margin for `t` (NaN sorts as the worst), or None when the figure is missing."""
    try:
        m = t.margin(r)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return m if m == m else float("-inf")


def evaluate(results: dict[str, dict | list[dict]], targets: list[Target] = TARGETS) -> list[Row]:
    """One row per target whose benchmark ran, judged on its worst run (the one with the least margin:
    a target holds only if it holds in every run). A figure missing from every run (the benchmark
    failed, or a run did not finish) is n/a, never a pass; one missing from some runs is judged on
    the others, and the row says how many."""
    rows = []
    for t in targets:
        if t.bench not in results:
            continue
        runs = _runs(results[t.bench])
        if t.median and len(runs) > 1:
            rows.append(_median_row(t, runs))
            continue
        judged = [(m, i, run) for i, run in enumerate(runs, 1) if (m := _judged(t, run["result"])) is not None]
        if not judged:
            try:
                target = t.target(runs[-1]["result"])
            except (KeyError, TypeError, ValueError):
                target = "?"
            rows.append(Row(t.bench, t.what, "not measured", target, "n/a"))
            continue
        judged.sort(key=lambda x: x[0])
        _, i, worst = judged[0]
        r = worst["result"]
        measured = t.shown(r)
        where = ""
        if len(runs) > 1:
            try:  # the medians of the figures it is made of, as in the benchmark's own table
                measured += f" (median {t.shown(summarize(runs))})"
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                pass
            if len(judged) < len(runs):
                measured += f", {len(judged)} of {len(runs)} runs measured it"
            where = f"run {i}, load {_load1(worst.get('load_before'))} -> {_load1(worst.get('load_after'))}"
            if worst.get("steal_pct") is not None:
                where += f", steal {worst['steal_pct']:g} %"
        rows.append(Row(t.bench, t.what, measured, t.target(r), "pass" if t.check(r) else "miss", where))
    return rows


def _median_row(t: Target, runs: list[dict]) -> Row:
    """A target judged on the median of its figures over the runs (the median of each run's own value)."""
    r = summarize(runs)
    try:
        measured, target, ok = t.shown(r), t.target(r), t.check(r)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return Row(t.bench, t.what, "not measured", "?", "n/a")
    return Row(t.bench, t.what, f"median {measured}", target, "pass" if ok else "miss",
               f"the median of {len(runs)} runs")


def _load1(load: list | tuple | None) -> str:
    return f"{load[0]:.2f}" if load else "?"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_table(rows: list[Row]) -> str:
    mark = {"pass": "**pass**", "miss": "**MISS**", "n/a": "n/a"}
    if not any(r.worst_run for r in rows):
        lines = ["| benchmark | figure | measured | target | |", "|---|---|---|---|---|"]
        lines += [f"| {r.bench} | {_cell(r.what)} | {_cell(r.measured)} | {_cell(r.target)} | {mark[r.status]} |"
                  for r in rows]
        return "\n".join(lines)
    lines = ["| benchmark | figure | worst run (median) | target | | worst run: 1-min load before -> after, steal during |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.bench} | {_cell(r.what)} | {_cell(r.measured)} | {_cell(r.target)} | {mark[r.status]} | "
              f"{_cell(r.worst_run)} |" for r in rows]
    return "\n".join(lines)


def render_figures(result: dict) -> str:
    """Every figure of one benchmark as a two-column table (plots and series are shown elsewhere)."""
    lines = ["| figure | value |", "|---|---|"]
    for k, v in result.items():
        if k.startswith("plot"):
            continue
        shown = f"{v:.4g}" if isinstance(v, float) else v
        lines.append(f"| `{k}` | {_cell(shown)} |")
    return "\n".join(lines)


def _shown(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render_runs(runs: list[dict], summary: dict) -> str:
    """Every figure of one benchmark over its runs: median, worst (where the name says which way is
    better) and each run's value; then each run's load average before and after, the probes, the
    hypervisor's steal during it, and its seconds."""
    n = len(runs)
    lines = ["| figure | median | worst | " + " | ".join(f"run {i}" for i in range(1, n + 1)) + " |",
             "|---|---|---|" + "---|" * n]
    for k, v in summary.items():
        if k.startswith("plot") or k.endswith("_worst") or k in ("repeat", "load_before", "load_after", *PROBES):
            continue
        each = [_shown(run["result"].get(k, "")) for run in runs]
        worst = summary.get(f"{k}_worst", "")
        lines.append(f"| `{k}` | {_cell(_shown(v))} | {_cell(_shown(worst))} | " + " | ".join(map(_cell, each)) + " |")
    lines += ["", "| run | load before (1, 5, 15 min) | load after | cpu / net probe before (ms) | steal during (%) "
              "| seconds |", "|---|---|---|---|---|---|"]
    lines += [f"| {i} | {load_text(run.get('load_before'))} | {load_text(run.get('load_after'))} | "
              f"{run.get('cpu_probe_ms', '?')} / {run.get('net_probe_ms', '?')} | {_shown(run.get('steal_pct', '?'))} | "
              f"{run.get('seconds', 0):.0f} |"
              for i, run in enumerate(runs, 1)]
    return "\n".join(lines)


# ---------------------------------------------------------------- machine


def machine_info() -> dict:
    info: dict = {"cores": os.cpu_count() or 0, "python": platform.python_version(), "platform": platform.platform()}
    try:
        info["cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = "not installed"
    return info


# ---------------------------------------------------------------- the report


def _fewer(runs: dict[str, list[dict]], repeat: int) -> str:
    """" (real: 1)": the benchmarks that ran fewer times than the rest (a long full run)."""
    fewer = {name: len(r) for name, r in runs.items() if len(r) < repeat}
    return " (" + ", ".join(f"{k}: {v}" for k, v in fewer.items()) + ")" if fewer else ""


def render_report(results: dict[str, dict], meta: dict, report_dir: Path,
                  runs: dict[str, list[dict]] | None = None) -> str:
    """`results`: each benchmark's flat summary (medians); `runs`: its runs, when it ran more than once."""
    m = meta["machine"]
    runs = runs or {}
    repeat = meta.get("repeat", 1)
    lines = [
        "# brigade benchmarks",
        "",
        f"Generated by `{meta['command']}` on {meta['date']}; {'quick mode' if meta['quick'] else 'full mode'}, "
        f"{meta['total_s']:.0f} s in all. Every ratio compares with a baseline measured in the same run, on the "
        "same machine; nothing is carried over from another run."
        + (f" Each benchmark ran {repeat} times in a row{_fewer(runs, repeat)}: a figure is shown as its median "
           "and its worst run, and each target is judged on the worst run." if repeat > 1 else ""),
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('cpu', '?')}, {m.get('cores', '?')} cores ({m.get('cores_usable', '?')} usable)",
        f"- memory: {m.get('memory_gib', '?')} GiB",
        f"- torch {m.get('torch', '?')}, Python {m.get('python', '?')}, {m.get('platform', '')}",
        f"- load average (1, 5, 15 min) before: {meta['load_before']}, after: {meta['load_after']} "
        "(a shared machine: other jobs' load shows up in every wall-clock figure; each run's own is in its "
        "benchmark's section)",
        "",
        "## Targets",
        "",
        render_table(evaluate({k: runs.get(k, v) for k, v in results.items()})),
        "",
    ]
    for name in [*ORDER, *(n for n in results if n not in ORDER)]:
        if name not in results:
            continue
        r = results[name]
        secs = meta["seconds"].get(name)
        lines += [f"## {name}", "", f"`brigade bench {name}{' --quick' if meta['quick'] else ''}"
                  + (f" --repeat {repeat}" if repeat > 1 else "") + "`"
                  + (f", {secs:.0f} s" if secs is not None else "") + ".", ""]
        doc = meta["docs"].get(name, "")
        if doc:
            lines += [doc, ""]
        note = NOTES.get(name, lambda r: "")(r)
        if note:
            lines += [(f"From the medians of the {repeat} runs. " if repeat > 1 else "") + note, ""]
        for key, path in r.items():
            if key.startswith("plot") and not key.endswith("_worst") and isinstance(path, str) and path:
                rel = os.path.relpath(Path(path).resolve(), report_dir.resolve())
                lines += [f"![{name} {key}{' (last run)' if repeat > 1 else ''}]({rel})", ""]
        lines += [render_runs(runs[name], r) if len(runs.get(name, ())) > 1 else render_figures(r), ""]
    return "\n".join(lines)


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def run_all(quick: bool, report_path: str | Path, names: list[str] | None = None, repeat: int = 0) -> dict[str, dict]:
    """Every benchmark `repeat` times (0: each its default, brigade_bench.repeat.default_repeat), then
    the report and results.json."""

    report_path = Path(report_path)
    out_dir = report_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}
    seconds: dict[str, float] = {}
    docs: dict[str, str] = {}
    load_before = load_text(loadavg())
    t_all = time.monotonic()
    flags = (" --quick" if quick else "") + (f" --repeat {repeat}" if repeat > 1 else "")
    for name in names or ORDER:
        t0 = time.monotonic()
        print(f"== bench {name}{flags}", flush=True)
        try:
            docs[name] = _first_paragraph(bench_module(name).__doc__)
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
            docs[name] = ""
            runs[name] = [{"result": {"error": f"{type(e).__name__}: {e}"[:2000]}}]
        else:
            runs[name] = run_repeated(name, quick, repeat or default_repeat(name, quick), out_dir)
        results[name] = summarize(runs[name])
        seconds[name] = time.monotonic() - t0
        print(json.dumps(results[name]), flush=True)
        print(f"== {name}: {seconds[name]:.0f} s", flush=True)
    meta = {
        "command": f"brigade bench all{flags} --report {report_path}",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "quick": quick,
        "repeat": max((len(r) for r in runs.values()), default=1),
        "total_s": time.monotonic() - t_all, "seconds": seconds, "docs": docs, "machine": machine_info(),
        "load_before": load_before, "load_after": load_text(loadavg()),
    }
    report_path.write_text(render_report(results, meta, out_dir, runs))
    (out_dir / "results.json").write_text(json.dumps({"meta": {k: v for k, v in meta.items() if k != "docs"},
                                                      "results": results, "runs": runs}, indent=1, default=str))
    print(f"report: {report_path} ({meta['total_s']:.0f} s in all)", flush=True)
    return results
