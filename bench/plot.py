"""Draws docs/bench.png from docs/bench.json: latency percentiles per scenario (HDR-style: the
x axis spreads the tail, 50% .. 99.99%), one panel per connection count.

    .venv/bin/python bench/plot.py docs/bench.json docs/bench.png
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "plain": ("plain Envoy (router only)", "black", "-"),
    "jwt": ("Envoy + jwt_authn", "grey", "--"),
    "new": ("new keys (claim, upstream, complete)", "tab:blue", "-"),
    "new_bg": ("new keys, complete_in_background", "tab:cyan", "--"),
    "new_single": ("new keys, batch_max = 1", "tab:blue", ":"),
    "new_tls": ("new keys, state API over mTLS", "tab:blue", "-."),
    "seed_new": ("seeds' design: new keys", "tab:brown", "-"),
    "seed_edge": ("seeds' design behind Envoy + jwt_authn", "tab:brown", "--"),
    "seed_inflight": ("seeds' design: in-flight duplicates", "tab:pink", "-"),
    "replay": ("replays (completed keys)", "tab:green", "-"),
    "inflight": ("in-flight duplicates (409)", "tab:orange", "-"),
    "state_api": ("state API claim+complete (direct)", "tab:purple", "-"),
    "state_api_dup": ("state API claim of a completed key (direct)", "tab:olive", "--"),
    "pgbench": ("pgbench INSERT ON CONFLICT", "tab:red", ":"),
}


def x_of(p):
    # 0 -> 0, 50 -> 0.3, 90 -> 1, 99 -> 2, 99.9 -> 3 ...
    p = min(p, 99.999)
    return math.log10(100.0 / (100.0 - p))


def main(src, dst):
    with open(src) as f:
        report = json.load(f)
    series = {}
    for s in report["scenarios"]:
        series.setdefault(s["connections"], []).append((s["scenario"], s["percentiles"], s["rate"]))
    for p in report.get("pgbench", []):
        series.setdefault(p["clients"], []).append(("pgbench", p["percentiles"], p["tps"]))
    conns = sorted(series)
    fig, axes = plt.subplots(1, len(conns), figsize=(6.5 * len(conns), 5), squeeze=False)
    ticks = [50, 90, 99, 99.9, 99.99]
    for ax, c in zip(axes[0], conns):
        for name, pts, rate in series[c]:
            label, color, ls = STYLE.get(name, (name, None, "-"))
            pts = [(p, ms) for p, ms in pts if p >= 50 and p < 100 and ms is not None]
            if not pts:
                continue
            ax.plot([x_of(p) for p, _ in pts], [ms for _, ms in pts], ls, color=color, marker="o", ms=3,
                    label=f"{label}: {rate:,.0f}/s")
        ax.set_yscale("log")
        ax.set_xticks([x_of(t) for t in ticks])
        ax.set_xticklabels([f"p{t:g}" for t in ticks])
        ax.set_ylabel("latency, ms (log)")
        ax.set_title(f"{c} connection{'s' if c != 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Idempotency layer vs plain Envoy and raw Postgres (closed loop, Envoy --concurrency 1, 2 cores)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
