#!/usr/bin/env bash
# Nsight Compute stall reasons of gemv_tma's checking launches of the gate+up and down GEMVs
# (run from experiments/ after building gemv_tma; six variants per matrix).
m=smsp__average_warps_issue_stalled_
ms=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active
for k in long_scoreboard short_scoreboard mio_throttle wait not_selected math_pipe_throttle; do ms=$ms,${m}${k}_per_issue_active.ratio; done
ncu --clock-control none -k regex:"gemv_" --launch-skip 12 --launch-count 12 --csv --page raw --metrics "$ms" ./gemv_tma 2 x x >prof.csv 2>prof.err
python3 - <<'PY'
import csv
rows = list(csv.reader(open("prof.csv")))
h = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
head, data = rows[h], rows[h + 2:]
for d in data:
    vals = []
    for i, c in enumerate(head):
        if c.startswith(("gpu__", "dram__", "smsp__")):
            name = c.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "").split(".")[0]
            vals.append(f"{name}={d[i]}")
    print(d[head.index("Kernel Name")][:48], " ".join(vals))
PY
