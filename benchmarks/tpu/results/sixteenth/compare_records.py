"""Every metric series of every run of two TPU records, compared value by value (bitwise)."""
import json, sqlite3, sys
def load(store):
    m = json.load(open(f"{store}/manifest.json"))
    db = sqlite3.connect(f"{store}/mlflow.db")
    out = {}
    for r in m["runs"]:
        rows = db.execute("select key, step, value from metrics where run_uuid=? order by key, step, timestamp", (r["run_id"],)).fetchall()
        out[r["variant"]] = rows
    for c in m.get("matmul_check") or []:
        rows = db.execute("select key, step, value from metrics where run_uuid=? order by key, step, timestamp", (c["run_id"],)).fetchall()
        out[c["variant"]] = rows
    return m, out
ma, a = load(sys.argv[1]); mb, b = load(sys.argv[2])
print("jax", ma["jax"], mb["jax"], "runs", len(a), len(b))
same = diff = 0
for v in sorted(set(a) | set(b)):
    la = [(k, s, x) for k, s, x in a.get(v, []) if k == "loss" or k.startswith("eval/") or k.startswith("train/")]
    lb = [(k, s, x) for k, s, x in b.get(v, []) if k == "loss" or k.startswith("eval/") or k.startswith("train/")]
    ok = la == lb and len(la) > 0
    same += ok; diff += not ok
    if not ok:
        print("DIFF", v, len(la), len(lb), next(((p, q) for p, q in zip(la, lb) if p != q), None))
print("identical", same, "different", diff)
