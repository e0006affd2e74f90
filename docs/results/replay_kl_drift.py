# Replays rpg_trl.reliability.kl_drift.KLDriftMonitor (its current rules and default floor) on the logged metrics of
# the runs of a KL table and a KL sweep, and counts its warnings among the runs that collapsed (caught; the others are
# misses) and among the runs that held (false alarms):
#   python docs/results/replay_kl_drift.py runs/kl3   (the output folder of `rpg-trl bench-algos --tables kl kl_sweep`)
import json
import sys
import warnings

from rpg_trl.reliability.kl_drift import KLDriftMonitor


report = json.load(open(sys.argv[1] + "/results.json"))
rows = []
for table in ("kl", "kl_sweep"):
    for run in report.get(table, {}).get("runs", []):
        if run["beta"] == 0:
            continue  # no KL, nothing to watch
        monitor = KLDriftMonitor(16, 10.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for entry in json.load(open(run["run_dir"] + "/trainer_state.json"))["log_history"]:
                if "kl" in entry:
                    monitor.observe(entry, entry["step"])
        rows.append((table, run["arm"], run["seed"], run["collapsed"], monitor.warned, len(monitor.batches)))
for collapsed, label in ((True, "collapsed"), (False, "held")):
    group = [row for row in rows if row[3] == collapsed]
    warned = [row for row in group if row[4]]
    print(f"{label}: warned on {len(warned)} of {len(group)} runs")
    for table, arm, seed, _, was_warned, _ in group:
        if was_warned != collapsed:
            print(f"  {'false alarm' if was_warned else 'missed'}: {table} / {arm} / seed {seed}")
