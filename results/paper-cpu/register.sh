#!/usr/bin/env bash
# Registers the out-of-range prediction (section 2, phase 3 of README.md): the paper
# law fitted on every finished run at L <= 2048, its predictions with intervals for
# the X-MoD runs at L = 4096 (K = 8, 16, 24; A = 1; seed 0), each under the run id the
# sweep will give it, and `xmod recommend`'s best K at 4096. It writes only under
# OUT (default results/paper-cpu/registered) and starts no run: the X-MoD entries at
# 4096 go into the spec in a later commit than this script's output.
#
# Run from the repository root, where `data/corpus` is the corpus the study ran on
# (the path is part of each run's id):
#
#     results/paper-cpu/register.sh [OUT]
set -euo pipefail

out=${1:-results/paper-cpu/registered}
study=results/paper-cpu
xmod=${XMOD:-xmod}
python=${PYTHON:-python}
compute=1.164e14
mkdir -p "$out"

# the table as the run records give it now (with params_non_embedding, which the
# law's counts need), then the law, on L <= 2048: no X-MoD run at 4096 exists yet, and the dense one there only
# serves as the reference of the prediction
"$xmod" results "$study" > /dev/null
"$xmod" law fit "$study/results.csv" --form paper --min-steps 0 --quiet \
    --out "$out/law.json" --plots "$out/plots" > "$out/fit.txt"

# the runs to predict, as the sweep will plan them: the study's spec with the 4096
# entries added, planned (not run) into the study's own directory
"$python" - "$out" "$compute" <<'EOF'
import sys
from importlib import resources
from pathlib import Path

import yaml

out, compute = Path(sys.argv[1]), float(sys.argv[2])
shipped = resources.files("xmodlm") / "configs" / "sweeps" / "paper-cpu.yaml"
spec = yaml.safe_load(shipped.read_text())
spec["families"].append({"family": "xmod", "sparsity": [8, 16, 24], "anchor_stride": 1,
                         "compute": {4096: [compute]}})
(out / "spec-4096.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
EOF
"$xmod" sweep "$out/spec-4096.yaml" --dry-run --data data/corpus --out "$study" \
    --plan "$out/plan.csv" > /dev/null
"$python" - "$out" <<'EOF'
import sys
from pathlib import Path

import pandas as pd

out = Path(sys.argv[1])
plan = pd.read_csv(out / "plan.csv")
rows = plan[(plan["context"] == 4096) & (plan["family"] == "xmod")]
if len(rows) != 3:
    sys.exit(f"expected the 3 X-MoD runs at L = 4096 in the plan, found {len(rows)}")
rows.to_csv(out / "rows.csv", index=False)
EOF

"$xmod" law predict "$out/law.json" --input "$out/rows.csv" > "$out/predictions.csv"
"$xmod" recommend --law "$out/law.json" --compute "$compute" --context 4096 \
    --backbone cpu-d64 --dense-prefix 2 --vocab-size 4096 > "$out/recommend.txt"
echo "registered in $out: law.json, plots/, rows.csv, predictions.csv, recommend.txt"
