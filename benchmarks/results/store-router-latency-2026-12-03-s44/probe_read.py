import json, sys, statistics as st, glob
def med(xs): return st.median(xs) if xs else float('nan')
for path in sorted(glob.glob(sys.argv[1] if len(sys.argv)>1 else "/tmp/s44-probe-*.jsonl")):
    recs=[json.loads(l) for l in open(path)]
    recs=recs[len(recs)//6:]  # skip warm-up-ish
    pg = any(r.get("spec") for r in recs)
    print(path, "postgres" if pg else "sqlite", len(recs))
    groups={"plain":[r for r in recs if not r["agent"]],
            "agent-later(spec)":[r for r in recs if r["agent"] and r["spec"]],
            "agent-nospec":[r for r in recs if r["agent"] and not r["spec"]]}
    if pg:
        groups["spec awaited"]=[r for r in recs if r.get("spec") and r.get("awaited")]
        groups["spec not awaited"]=[r for r in recs if r.get("spec") and not r.get("awaited")]
    for g,rs in groups.items():
        rs=[r for r in rs if all(k in r for k in ("prep","enter0","enter1","post0","head","confirmed","settle0","settle1","sent"))]
        if not rs: continue
        def d(a,b): return med([(r[b]-r[a])/1e3 for r in rs])
        line=f"  {g:18s} n={len(rs):4d} prep->enter0 {d('prep','enter0'):6.0f} enter {d('enter0','enter1'):5.0f} ->post {d('enter1','post0'):5.0f} engine {d('post0','head'):6.0f} wait {d('head','confirmed'):5.0f} ->settle {d('confirmed','settle0'):5.0f} settle {d('settle0','settle1'):5.0f} ->sent {d('settle1','sent'):5.0f} total {d('prep','sent'):6.0f}"
        sa=[(r["sa"]-r["post0"])/1e3 for r in rs if r.get("sa")]
        if sa: line+=f" answer@post+{med(sa):.0f}"
        print(line)
