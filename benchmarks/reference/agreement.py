"""Agreement check: the same fixed workload through gpupool's harness and `vllm bench serve`,
alternated against one real engine, each run bracketed by scrapes of the engine's own
`/metrics`, so each tool is compared with the engine on the very same requests as well as
with the other tool. Usage (from the repository root):

    .venv/bin/python benchmarks/reference/agreement.py http://127.0.0.1:8401 out/agreement \
        --rounds 4 --duration-s 30

Workload: `benchmarks/scenarios/agreement.yaml` (Poisson 6 req/s, 256-token chat prompts with
the template, 64 output tokens, ignore_eos). vllm gets `--random-input-len 248` (it counts the
chat template's 8 tokens on top) and the same number of requests. The engine side is the
means of `vllm:time_to_first_token_seconds` and `vllm:request_time_per_output_token_seconds`
over the run (their buckets are too coarse for percentiles at these latencies). The engine
measures from the request's arrival in the engine, after HTTP parsing, chat templating and
tokenization, so a client's TTFT sits a little above it.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "benchmarks" / "scenarios" / "agreement.yaml"
_SERIES = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def scrape(url: str) -> dict[str, float]:
    """Sums over label sets of every `vllm:*_sum` and `vllm:*_count` series."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1).endswith(("_sum", "_count")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def engine_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    def mean(name: str) -> float:
        n = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
        s = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
        return 1e3 * s / n if n else float("nan")

    return {
        "ttft_mean_ms": mean("vllm:time_to_first_token_seconds"),
        "tpot_mean_ms": mean("vllm:request_time_per_output_token_seconds"),
    }


def request_count(duration_s: float) -> int:
    sys.path.insert(0, str(REPO))
    from router.simulate.prompts import PromptMaker
    from router.simulate.scenario import load_scenario
    from router.simulate.workload import build_plan

    scenario = dataclasses.replace(load_scenario(SCENARIO), duration_s=duration_s)
    return len(build_plan(scenario, PromptMaker(None)).chat)


def run_gpupool(url: str, out: Path, duration_s: float) -> dict[str, Any]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--scenario",
            str(SCENARIO),
            "--target",
            url,
            "--target-name",
            "engine",
            "--out",
            str(out),
            "--no-progress",
            "--pause-s",
            "0",
            "--duration-s",
            str(duration_s),
        ],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    c = json.loads((out / "report.json").read_text())["targets"][0]["classes"]["normal"]
    return {
        "n": c["ok"],
        "ttft_p50_ms": c["ttft_ms"]["p50"],
        "ttft_mean_ms": c["ttft_ms"]["mean"],
        "tpot_p50_ms": c["tpot_ms"]["p50"],
        "tpot_mean_ms": c["tpot_ms"]["mean"],
        "prompt_tokens_mean": c["prompt_tokens_mean"],
    }


def run_vllm(url: str, out: Path, n: int, seed: int) -> dict[str, Any]:
    from benchmarks.outputs import bulk_path

    with bulk_path(out.parent, f"{out.name}.log").open("w") as log:
        subprocess.run(
            [
                sys.executable,
                str(REPO / "benchmarks" / "reference" / "vllm_bench_serve.py"),
                "--backend",
                "openai-chat",
                "--endpoint",
                "/v1/chat/completions",
                "--base-url",
                url,
                "--model",
                "tiny",
                "--tokenizer",
                str(REPO / ".gpupool" / "models" / "tiny"),
                "--dataset-name",
                "random",
                "--random-input-len",
                "248",
                "--random-output-len",
                "64",
                "--random-range-ratio",
                "0",
                "--num-prompts",
                str(n),
                "--request-rate",
                "6",
                "--ignore-eos",
                "--seed",
                str(seed),
                "--disable-tqdm",
                "--save-result",
                "--result-dir",
                str(out),
            ],
            cwd=REPO,
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    v = json.loads(Path(glob.glob(str(out / "*.json"))[0]).read_text())
    return {
        "n": v["completed"],
        "ttft_p50_ms": v["median_ttft_ms"],
        "ttft_mean_ms": v["mean_ttft_ms"],
        "tpot_p50_ms": v["median_tpot_ms"],
        "tpot_mean_ms": v["mean_tpot_ms"],
        "prompt_tokens_mean": v["total_input_tokens"] / v["completed"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="gpupool harness vs vllm bench serve")
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=30.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = request_count(args.duration_s)
    rows = []
    for r in range(1, args.rounds + 1):
        for tool in ("gpupool", "vllm"):
            before = scrape(args.url)
            client = (
                run_gpupool(args.url, out / f"gpupool-{r}", args.duration_s)
                if tool == "gpupool"
                else run_vllm(args.url, out / f"vllm-{r}", n, r)
            )
            rows.append(
                {
                    "round": r,
                    "tool": tool,
                    **client,
                    "engine": engine_means_ms(before, scrape(args.url)),
                }
            )
    (out / "agreement.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(
        "| round | tool | n | prompt tokens | TTFT p50 | TTFT mean | engine TTFT mean "
        "| TPOT p50 | TPOT mean | engine TPOT mean |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        e = row["engine"]
        print(
            f"| {row['round']} | {row['tool']} | {row['n']} | {row['prompt_tokens_mean']:.1f} "
            f"| {row['ttft_p50_ms']:.2f} | {row['ttft_mean_ms']:.2f} | {e['ttft_mean_ms']:.2f} "
            f"| {row['tpot_p50_ms']:.3f} | {row['tpot_mean_ms']:.3f} "
            f"| {e['tpot_mean_ms']:.3f} |"
        )
    for metric in ("ttft", "tpot"):
        ratios = sorted(
            g[f"{metric}_p50_ms"] / v[f"{metric}_p50_ms"]
            for g, v in zip(rows[0::2], rows[1::2], strict=True)
        )
        print(
            f"{metric.upper()} p50 gpupool/vllm per round: " + ", ".join(f"{x:.3f}" for x in ratios)
        )
        for tool in ("gpupool", "vllm"):
            own = [row for row in rows if row["tool"] == tool]
            gaps = [row[f"{metric}_mean_ms"] / row["engine"][f"{metric}_mean_ms"] for row in own]
            print(f"  {tool} mean / engine mean: " + ", ".join(f"{x:.3f}" for x in gaps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
