"""Draws docs/soak.png from docs/soak.json (`make soak`): the figures over time, read every few
seconds (sizes, tuples, memory) or counted per minute (latency, rates), and the verdict (the last
minute against the second, with the band that passes).

    .venv/bin/python bench/plot_soak.py docs/soak.json docs/soak.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1024 * 1024


def main(src, dst):
    with open(src) as f:
        report = json.load(f)
    samples = report["samples"]
    minutes = report["minutes"]
    minute_s = report["settings"]["minute_s"]
    t = [s["t_s"] / minute_s for s in samples]
    # Per-minute figures drawn at the middle of their minute.
    tm = [m["minute"] - 0.5 for m in minutes]

    fig, axes = plt.subplots(3, 2, figsize=(13, 12))
    (ax_size, ax_tup), (ax_rss, ax_lat), (ax_rate, ax_verdict) = axes

    ax_size.plot(t, [s["table_bytes"] / MIB for s in samples], label="table")
    ax_size.plot(t, [s["index_bytes"] / MIB for s in samples], label="indexes")
    ax_size.plot(t, [s["total_bytes"] / MIB for s in samples], label="total (with TOAST)")
    ax_size.set_title("idempotency_records on disk")
    ax_size.set_ylabel("MiB")

    ax_tup.plot(t, [s["rows"] for s in samples], label="rows (count(*))")
    ax_tup.plot(t, [s["dead_tuples"] for s in samples], label="dead tuples (n_dead_tup)")
    vac = [
        (m["minute"] - 0.5, m["autovacuums"]) for m in minutes if m["autovacuums"] > 0
    ]
    ax_tup.set_title("rows and dead tuples (autovacuums per minute on top)")
    ax_tup.set_ylabel("tuples")
    top = max([s["rows"] for s in samples] + [s["dead_tuples"] for s in samples] + [1])
    for x, n in vac:
        ax_tup.annotate(f"{n}", (x, top), ha="center", va="bottom", fontsize=8, color="grey")

    ax_rss.plot(t, [s["state_api_rss_kib"] / 1024 for s in samples], label="state API")
    ax_rss.plot(t, [s["envoy_rss_kib"] / 1024 for s in samples], label="Envoy")
    ax_rss.set_title("resident memory (VmRSS)")
    ax_rss.set_ylabel("MiB")

    ax_lat.plot(tm, [m["p50_ms"] for m in minutes], "o-", color="tab:blue", label="p50 (minute)")
    ax_lat.plot(tm, [m["p99_ms"] for m in minutes], "o-", color="tab:orange", label="p99 (minute)")
    # The same over each reading interval, drawn at its middle.
    half = report["settings"]["sample_s"] / 2 / minute_s
    ti = [x - half for x in t[1:]]
    ax_lat.plot(ti, [s.get("new_p50_ms") for s in samples[1:]], color="tab:blue", alpha=0.35,
                linewidth=0.8, label="p50 (interval)")
    ax_lat.plot(ti, [s.get("new_p99_ms") for s in samples[1:]], color="tab:orange", alpha=0.35,
                linewidth=0.8, label="p99 (interval)")
    ax_lat.set_title("new-key latency")
    ax_lat.set_ylabel("ms")
    ax_lat.set_ylim(bottom=0)
    ax_other = ax_lat.twinx()
    ax_other.plot(tm, [m["other_cores"] for m in minutes], ":", color="grey",
                  label="other work on the machine")
    ax_other.set_ylabel("other work (cores)", color="grey")
    ax_other.set_ylim(0, max([m["other_cores"] for m in minutes] + [0.5]) * 1.2)
    ax_other.legend(fontsize=8, loc="lower left")

    ax_rate.plot(tm, [m["new_per_s"] for m in minutes], "o-", label="new keys")
    ax_rate.plot(tm, [m["purged_rows"] / minute_s for m in minutes], "o-", label="purged rows")
    ax_rate.plot(tm, [m["replays"] / minute_s for m in minutes], "o-", label="replays")
    ax_rate.plot(tm, [m["conflicts"] / minute_s for m in minutes], "o-", label="409s")
    failed = [(m["minute"] - 0.5, m["failures"]) for m in minutes if m["failures"] > 0]
    if failed:
        ax_rate.plot([x for x, _ in failed], [n / minute_s for _, n in failed], "rx",
                     label="failures", markersize=10)
    ax_rate.set_title("per second, by minute")
    ax_rate.set_ylabel("/s")
    ax_rate.set_ylim(bottom=0)

    for ax in (ax_size, ax_tup, ax_rss, ax_lat, ax_rate):
        ax.set_xlabel(f"minute ({minute_s} s)")
        ax.set_xlim(0, len(minutes))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        # The two minutes the verdict compares.
        for m in (2, len(minutes)):
            ax.axvspan(m - 1, m, color="tab:green", alpha=0.06)

    verdict = report["verdict"]
    names = [v["figure"] for v in verdict]
    # A figure without a value in a minute (no answer: JSON null) is drawn as 0.
    pct = [100.0 * v["change"] / v["second"] if v["second"] and v["change"] is not None else 0.0
           for v in verdict]
    band = [100.0 * v["allowed"] / v["second"] if v["second"] else 0.0 for v in verdict]
    y = range(len(verdict))
    ax_verdict.barh(y, [2 * b for b in band], left=[-b for b in band], color="tab:green",
                    alpha=0.15, label="passes (20 % or the floor)")
    ax_verdict.barh(y, pct, height=0.5,
                    color=["tab:blue" if v["pass"] else "tab:red" for v in verdict],
                    label="last minute vs second")
    ax_verdict.set_yticks(list(y))
    ax_verdict.set_yticklabels(names, fontsize=8)
    ax_verdict.invert_yaxis()
    ax_verdict.axvline(0, color="black", linewidth=0.8)
    lim = max([abs(p) for p in pct] + [min(b, 60.0) for b in band] + [25.0]) * 1.1
    ax_verdict.set_xlim(-lim, lim)
    ax_verdict.set_xlabel("change, % of the second minute")
    ax_verdict.set_title("verdict: " + ("PASS" if report["pass"] else "FAIL"))
    ax_verdict.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)

    s = report["settings"]
    fig.suptitle(
        f"make soak: {s['minutes']} min, new keys at {report['rate']:.0f}/s on {s['connections']}"
        f" connections, retention {s['retention_s']} s, purge every {s['purge_interval_s']} s"
        f" (git {report['git']})"
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
