# Replays rpg_trl.reliability.kl_drift.KLDriftMonitor (its current rules and default floor) on the logged metrics of
# the runs of a KL table and a KL sweep, and counts its warnings among the runs that collapsed (caught; the others are
# misses), split by whether the KL to the warm start ran away (above 1 nat per token at the end), and among the runs
# that held (false alarms):
#   python docs/results/replay_kl_drift.py runs/kl3   (the output folder of `rpg-trl bench-algos --tables kl kl_sweep`)
#   python docs/results/replay_kl_drift.py docs/results/kl3_2026-11-26   (the committed results and logged metrics)
# With --at-end the monitor also evaluates each run's last period when its log ends, as the trainers do since the
# drift warning's figures were reported (the replay of the protocol, as fixed before the runs, does not).
import json
import os
import sys
import warnings

from rpg_trl.reliability.kl_drift import KLDriftMonitor


at_end = "--at-end" in sys.argv[1:]
folder = next(arg for arg in sys.argv[1:] if arg != "--at-end")
report = json.load(open(os.path.join(folder, "results.json")))
logged_path = os.path.join(folder, "logged_metrics.json")
logged = json.load(open(logged_path)) if os.path.exists(logged_path) else None


def history(run):
    if logged is not None:  # keyed by the run's folder below the command's output folder
        return next(entries for key, entries in logged.items() if run["run_dir"].endswith(key))
    return json.load(open(os.path.join(run["run_dir"], "trainer_state.json")))["log_history"]


rows = []
for table in ("kl", "kl_sweep"):
    for run in report.get(table, {}).get("runs", []):
        if run["beta"] == 0:
            continue  # no KL, nothing to watch
        monitor, when = KLDriftMonitor(16, 10.0), None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for entry in history(run):
                if "kl" in entry and monitor.observe(entry, entry["step"]) and when is None:
                    when = entry["step"]
            if at_end and monitor.finish() and when is None:
                when = "the end"
        name = f"{table} / {run['arm']} / β {run['beta']:g} / lr {run['learning_rate']:g} / seed {run['seed']}"
        rows.append((run["collapsed"], run["kl_to_warm_start"] > 1.0, monitor.warned, when, name))
groups = (
    ("collapsed, KL to warm start > 1 at the end", lambda r: r[0] and r[1]),
    ("collapsed, KL to warm start <= 1 at the end", lambda r: r[0] and not r[1]),
    ("held", lambda r: not r[0]),
)
for label, member in groups:
    group = [row for row in rows if member(row)]
    print(f"{label}: warned on {sum(row[2] for row in group)} of {len(group)} runs")
for collapsed, _, warned, when, name in rows:
    if warned != collapsed:
        print(f"  {'false alarm at step ' + str(when) if warned else 'missed'}: {name}")
    elif warned:
        print(f"  caught at step {when}: {name}")
