"""Plots from the perf results: memory vs context length, decode throughput vs batch,
requests running at once in one KV pool over time (capacity), pages held as outputs grow
(long_output), prefill seconds per phase (prefill_phases), whole runs end to end (end_to_end) and their
bounds (whole_run_bound).

    python -m benchmarks.perf.plot    # -> benchmarks/results/perf_memory.png, perf_throughput.png, capacity.png,
                                      #    long_output.png, prefill_phases.png, end_to_end.png,
                                      #    whole_run_bound.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
MIB = 2**20


def plot(result: dict, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    n = [r["length"] for r in rows]
    title = f"{result['model']}: {result['command'].strip()}"

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(n, [r["vllm"]["fast_tier_bytes"] / MIB for r in rows], "o-", label="stock vLLM: full KV")
    left.plot(n, [r["sekv"]["fast_tier_bytes"] / MIB for r in rows], "o-", label=f"sekv fast tier (budget {result['budget_ratio']})")
    left.plot(n, [r["sekv"]["host_pool_bytes"] / MIB for r in rows], "o--", label="sekv host pool (span bases)")
    left.plot(n, [r["sekv"]["vllm_pages_held_bytes"] / MIB for r in rows], "x:", color="C3",
              label="sekv: vLLM pages still held")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("MiB per request")
    left.legend(fontsize=8)
    right.plot(n, [r["vllm"]["peak_rss_bytes"] / MIB / 1024 for r in rows], "o-", label="stock vLLM")
    right.plot(n, [r["sekv"]["peak_rss_bytes"] / MIB / 1024 for r in rows], "o-", label="sekv")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("peak process RSS (GiB)")
    right.legend(fontsize=8)
    memory = _save(fig, title, folder / "perf_memory.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(rows):
        for backend, style in (("vllm", "o-"), ("sekv", "s--")):
            runs = r[backend]["runs"]
            ax.plot([x["batch"] for x in runs], [x["decode_tok_per_s"] for x in runs], style, color=f"C{i}",
                    label=f"{'stock' if backend == 'vllm' else 'sekv'} ~{r['length']}")
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=7)
    throughput = _save(fig, title, folder / "perf_throughput.png")
    return [memory, throughput]


def _save(fig, title: str | None, path: Path) -> Path:
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_capacity(result: dict, folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for backend, label in (("vllm", "stock vLLM"), ("sekv", f"sekv (budget {result['budget_ratio']})")):
        t, running = zip(*result[backend]["timeline"])
        ax.step(t, running, where="post", label=f"{label}: at most {result[backend]['max_concurrent']}")
    ax.set_xlabel("seconds since all requests were submitted")
    ax.set_ylabel("requests decoding at once")
    ax.set_title(f"{result[backend]['requests']} requests of ~{result['length']} tokens, one pool of "
                 f"{result['kv_cache_space_gib']} GiB: concurrency_ratio {result['concurrency_ratio']}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, None, folder / "capacity.png")


def plot_long_output(result: dict, folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = {"vllm": "stock vLLM", "sekv_window_kept": "sekv, output kept at full resolution",
              "sekv_window_spanified": f"sekv, window spanified every {result['window_growth']}"}
    for name, label in labels.items():
        tokens, pages = zip(*result[name]["pages_per_request"])
        ax.plot(tokens, pages, label=f"{label}: {result[name]['decode_tok_per_s']} decode tok/s")
    ax.set_xlabel("output tokens per request")
    ax.set_ylabel(f"vLLM pages held per request ({result['vllm']['block_size']} tokens each)")
    ax.set_title(f"{result['requests']} requests of ~{result['length']} prompt tokens, budget {result['budget_ratio']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, None, folder / "long_output.png")


def plot_prefill_phases(result: dict, source: Path) -> Path:
    """One bar per length and backend: its prefill split into phases (the profiled run's shares, scaled to the
    plain median, the time users see), drawn beside the results file `source` and named after it
    (prefill_phases_cpu.json -> prefill_phases.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.perf.prefill_phases import REST

    names = [REST, *[p for p in result["rows"][0]["sekv"]["phases"] if p != REST]]
    colors = plt.get_cmap("tab20").colors
    # tall enough for the legend's phases even with one length
    fig, ax = plt.subplots(figsize=(11, max(4.2, 1.2 + 0.6 * 2 * len(result["rows"]))))
    labels = []
    for row in result["rows"]:
        for backend in ("vllm", "sekv"):
            run, y = row[backend], len(labels)
            scale = run["prefill_seconds"] / run["profiled_seconds"]
            left = 0.0
            for i, name in enumerate(names):
                width = run["phases"].get(name, 0.0) * scale
                ax.barh(y, width, left=left, color=colors[i % len(colors)], label=name if y == 1 else None)
                left += width
            labels.append(f"{row['length']} {'stock' if backend == 'vllm' else 'sekv'}")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    beside = (f"beside {result['running']} requests decoding" if result.get("running")
              else "one request alone")
    ax.set_xlabel(f"prefill seconds ({beside}, to its second token)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    command = result["command"].strip().replace(" --out ", "\n--out ")  # a long command on two lines
    return _save(fig, f"{result['model']}: {command}", source.with_name(source.stem.removesuffix("_cpu") + ".png"))


def plot_end_to_end(result: dict, folder: Path) -> Path:
    """Requests running with output over each whole run (one panel per output length), and the
    figures users feel beside them: output tok/s, TTFT and TPOT p50, stock and sekv (and sekv's variants)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["whole_run"]
    backends = [("vllm", "stock vLLM"), ("sekv", f"sekv (budget {result['budget_ratio']})")]
    backends += [(name, f"sekv {json.dumps({k: v for k, v in v['sekv_config'].items() if k != 'budget_ratio'})}")
                 for name, v in result.get("variants", {}).items()]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), squeeze=False)
    for ax, (n_out, by_backend) in zip(axes[0], runs.items()):
        for backend, label in backends:
            r = by_backend[backend]
            t, running = zip(*r["timeline"])
            ax.step(t, running, where="post", label=f"{label}: {r['wall_s']:.0f} s, {r['output_tok_per_s']:.1f} out tok/s, "
                    f"TTFT p50 {r['ttft_s']['p50']:.0f} s, TPOT p50 {r['tpot_s']['p50']:.2f} s")
        ax.set_xlabel("seconds since all requests were submitted")
        ax.set_ylabel("requests decoding at once")
        ax.set_title(f"{result['requests']} x {result['length']}-token prompts, {n_out} output tokens: "
                     f"sekv/stock output tok/s {result['output_throughput_ratio'][n_out]}", fontsize=9)
        ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.1))
    return _save(fig, f"{result['model']}: {result['command'].strip()} ({result['kv_cache_space_gib']} GiB pool)",
                 folder / "end_to_end.png")


def plot_whole_run_bound(result: dict, source: Path) -> Path:
    """Per output length, stock's whole run and sekv's split into what any backend pays (stock's prefill steps,
    the model's step time at sekv's decode batches) and what sekv adds (its prefill extra, its decode attention),
    with the 2x target's wall time; drawn beside the results file `source` and named after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("stock_prefill_s", "prefill steps at stock's time"), ("sekv_prefill_extra_s", "sekv's prefill extra"),
             ("decode_floor_s", "decode steps at the model's step time"),
             ("decode_attention_s", "sekv's decode attention and its Python")]
    outputs = result["outputs"]
    fig, axes = plt.subplots(1, len(outputs), figsize=(5.5 * len(outputs), 4.4), squeeze=False)
    for ax, (n_out, b) in zip(axes[0], outputs.items()):
        ax.barh(1, b["stock_wall_s"], color="0.6")
        left = 0.0
        for i, (key, label) in enumerate(parts):
            ax.barh(0, b[key], left=left, color=f"C{i}", label=label)
            left += b[key]
        ax.axvline(b["target_2x_wall_s"], color="k", ls="--", label="2x stock's output tok/s")
        ax.set_yticks([0, 1], [f"sekv {b['sekv_wall_s']:.0f} s", f"stock {b['stock_wall_s']:.0f} s"])
        ax.set_xlabel("seconds of the whole run")
        ax.set_title(f"{n_out} output tokens: ceiling with free attention "
                     f"{b['throughput_ceiling_attention_free']}x, model alone {b['throughput_ceiling_model_only']}x",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    return _save(fig, f"{result['model']}: {result['command'].strip()} (runs: {result['runs']})",
                 source.with_name(source.stem.removesuffix("_cpu") + ".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", type=Path, default=RESULTS / "perf_cpu.json")
    parser.add_argument("--capacity", type=Path, default=RESULTS / "capacity_cpu.json")
    parser.add_argument("--long-output", type=Path, default=RESULTS / "long_output_cpu.json")
    parser.add_argument("--prefill-phases", type=Path, default=RESULTS / "prefill_phases_cpu.json")
    parser.add_argument("--end-to-end", type=Path, default=RESULTS / "end_to_end_cpu.json")
    parser.add_argument("--whole-run-bound", type=Path, default=RESULTS / "whole_run_bound_cpu.json")
    args = parser.parse_args()
    paths = plot(json.loads(args.results.read_text()), args.results.parent)
    if args.capacity.exists():
        paths.append(plot_capacity(json.loads(args.capacity.read_text()), args.capacity.parent))
    if args.long_output.exists():
        paths.append(plot_long_output(json.loads(args.long_output.read_text()), args.long_output.parent))
    if args.prefill_phases.exists():
        paths.append(plot_prefill_phases(json.loads(args.prefill_phases.read_text()), args.prefill_phases))
    if args.end_to_end.exists():
        paths.append(plot_end_to_end(json.loads(args.end_to_end.read_text()), args.end_to_end.parent))
    if args.whole_run_bound.exists():
        paths.append(plot_whole_run_bound(json.loads(args.whole_run_bound.read_text()), args.whole_run_bound))
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
