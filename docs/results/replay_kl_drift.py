# Replays rpg_trl.reliability.kl_drift.KLDriftMonitor on the logged metrics of a KL table's runs:
#   python docs/results/replay_kl_drift.py runs/kl2   (the output folder of `rpg-trl bench-algos --tables kl`)
import json
import sys
import warnings

from rpg_trl.reliability.kl_drift import KLDriftMonitor


report = json.load(open(sys.argv[1] + "/results.json"))
counts = {True: [0, 0], False: [0, 0]}
when = []
for run in report["kl"]["runs"]:
    if run["beta"] == 0:
        continue
    monitor = KLDriftMonitor(16, 10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for entry in json.load(open(run["run_dir"] + "/trainer_state.json"))["log_history"]:
            if "kl" in entry and monitor.observe(entry, entry["step"]):
                when.append(len(monitor.batches))
    counts[run["collapsed"]][0] += monitor.warned
    counts[run["collapsed"]][1] += 1
print(
    f"warned on {counts[True][0]} of {counts[True][1]} collapsed runs and {counts[False][0]} of {counts[False][1]} "
    f"that held; after generation batch {min(when)}-{max(when)}"
)
