"""The README's end-to-end rows from router_overhead.json files (issue 28, s47).

python table.py RUN_LABEL=DIR/router_overhead.json ...
"""

from __future__ import annotations

import json
import sys


def rows(label: str, path: str) -> list[str]:
    with open(path) as f:
        d = json.load(f)
    by = {t["name"]: t for t in d["targets"] if t.get("hi")}
    vr = by["vllm-router"]
    start, end = d["machine"]["load_average_at_start"][0], d["load_average_at_end"][0]
    time = d["date"].split(" ")[1] if " " in d["date"] else d["date"]
    out = []
    for name in ("gpupool", "gpupool-baseline", "vllm-router"):
        t = by[name]
        side = d["versions"].get(name, "").replace("git ", "") or name
        c1, hi, st = t["c1"], t["hi"], t["stream"]
        ratio = hi["cpu_us_per_unit"] / vr["hi"]["cpu_us_per_unit"]
        chunk = st["cpu_us_per_unit"] / vr["stream"]["cpu_us_per_unit"]
        per_round = ", ".join(f"{x:.2f}" for x in c1["added_p50_ms_rounds"])
        rps = ", ".join(f"{x:,.0f}" for x in hi["rate_per_s_rounds"])
        out.append(
            f"| {label} ({time}, {start:.1f} → {end:.1f}) | {side} | {c1['added_p50_ms']:.2f}"
            f" ({per_round}) | {c1['cpu_us_per_unit']:.0f} | **{hi['cpu_us_per_unit']:.0f}** |"
            f" {ratio:.2f} x | {rps} | {hi['engine_cpu_us_per_unit']:.0f} |"
            f" {st['cpu_us_per_unit']:.1f} ({chunk:.2f} x) |"
        )
    return out


def main() -> None:
    print(
        "| run (time, load average start → end) | side | added p50 at c=1, ms (by round) |"
        " CPU / request c=1, µs | CPU / request c=64, µs | ratio to vllm-router |"
        " req/s c=64 (by round) | engine CPU / request c=64, µs | CPU / streamed chunk, µs"
        " (ratio) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for arg in sys.argv[1:]:
        label, _, path = arg.partition("=")
        for row in rows(label, path):
            print(row)


if __name__ == "__main__":
    main()
