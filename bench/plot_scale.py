"""Draws docs/scale.png from docs/scale.json (`make bench-scale`): one panel per curve, each
against its own first point. A curve the run did not measure leaves its panel empty.

    .venv/bin/python bench/plot_scale.py docs/scale.json docs/scale.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1024 * 1024


def empty(ax, title):
    ax.set_title(title)
    ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes,
            color="grey")


def records(ax, c):
    ax.set_title("1. records in the table: claim+complete at 16 connections")
    # Rows from before trials were named carry none: they ran with the cluster's settings.
    plain = [x for x in c["levels"] if not x.get("trial")]
    rows = [max(x["rows"], 1) for x in plain]
    ax.plot(rows, [x["cpu_us"] for x in plain], "o-", label="µs CPU per pair (state API + Postgres)")
    ax.plot(rows, [x["wal_bytes_per_pair"] / 100 for x in plain], "s--", label="WAL per pair (100 B)")
    for marker, x in zip("DPX*", [x for x in c["levels"] if x.get("trial")]):
        ax.plot([max(x["rows"], 1)], [x["cpu_us"]], marker, label=f"µs CPU per pair, {x['trial']}")
    ax.set_xscale("symlog", linthresh=100_000)
    ax.set_xlabel("rows loaded")
    p99 = ax.twinx()
    p99.plot(rows, [x["p99_ms"] for x in plain], "^:", color="tab:red", label="p99 ms")
    p99.set_ylabel("p99 ms", color="tab:red")
    ax.legend(loc="upper left", fontsize=7)
    for s in c.get("skipped", []):
        ax.annotate(f"{s['rows']:,} rows: not loaded (disk)", (0.02, 0.02), xycoords="axes fraction",
                    fontsize=7, color="grey")


def steady(ax, c):
    ax.set_title("2. steady state under the purge")
    samples = c["samples"]
    t = [s["t_s"] / 60 for s in samples]
    ax.plot(t, [s["table_bytes"] / MIB for s in samples], label="table MiB")
    ax.plot(t, [s["index_bytes"] / MIB for s in samples], label="indexes MiB")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    dead = ax.twinx()
    dead.plot(t, [s["dead_tuples"] for s in samples], color="grey", alpha=0.5, label="dead tuples")
    dead.set_ylabel("dead tuples", color="grey")
    p99 = [(m["minute"] - 0.5, m["p99_ms"]) for m in c["by_minute"]]
    ax.plot([x for x, _ in p99], [y for _, y in p99], "o:", color="tab:red", markersize=3,
            label="new-key p99 ms (per minute)")
    ax.axvspan((c["first"]["from_minute"] - 1), c["first"]["to_minute"], color="tab:green", alpha=0.08)
    ax.axvspan((c["last"]["from_minute"] - 1), c["last"]["to_minute"], color="tab:green", alpha=0.08)
    ax.legend(loc="upper left", fontsize=7)


def body(ax, c):
    ax.set_title("3. body size: fingerprint MiB/s (V8, and natively dashed)")
    costs = c.get("costs") or {}
    for engine, style in (("v8", "-"), ("native", "--")):
        rows = costs.get(engine, [])
        b = [x["bytes"] for x in rows]
        for key, marker, color, label in (("sha256_mib_per_s", "o", "tab:blue", "SHA-256 (floor)"),
                                          ("opaque_mib_per_s", "s", "tab:orange", "opaque"),
                                          ("json_mib_per_s", "^", "tab:green", "JSON, canonical")):
            ax.plot(b, [x[key] for x in rows], marker + style, color=color,
                    label=f"{label}, {'V8' if engine == 'v8' else 'natively'}")
    if costs:  # a run of the burst alone has no sizes to put on a log scale
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("body bytes")
    ax.set_ylabel("MiB/s")
    text = "\n".join(
        f"{x['envoy']} ({x['max_buffered_mib']:.0f} MiB): {x['requests']} x 1 MiB, "
        f"{x['created']} x 201, {x['refused_503']} x 503, Envoy +{x['growth_mib']:.0f} MiB"
        for x in c["bursts"]
    )
    ax.text(0.02, 0.02, text, transform=ax.transAxes, fontsize=7, va="bottom")
    ax.legend(loc="upper left", fontsize=7)


def routes(ax, c):
    ax.set_title("4. routes: Envoy µs of CPU per request")
    plain = [x for x in c["points"] if not x.get("variant")]
    n = [x["routes"] for x in plain]
    ax.plot(n, [x["matched_envoy_us"] for x in plain], "o-", label="matched (replay)")
    ax.plot(n, [x["unmatched_envoy_us"] for x in plain], "s-", label="unmatched (passed on)")
    for x in [x for x in c["points"] if x.get("variant")]:
        ax.plot([x["routes"]], [x["unmatched_envoy_us"]], "D", label=f"unmatched, {x['variant']}")
    ax.set_xscale("log")
    ax.set_xlabel("routes")
    ax.set_ylabel("µs")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=7)


def clients(ax, c):
    ax.set_title("5. clients: answers per second by class")
    for kind, cls, style in [("new keys", "created", "o-"), ("new keys", "503", "x:"),
                             ("replays", "replayed", "s-")]:
        pts = [(p["connections"], p["classes"].get(cls, {}).get("per_s", 0))
               for p in c["points"] if p["kind"] == kind]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=f"{kind}: {cls}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("connections")
    ax.set_ylabel("answers/s")
    p99 = ax.twinx()
    pts = [(p["connections"], p["all_p99_ms"]) for p in c["points"] if p["kind"] == "new keys"]
    p99.plot([x for x, _ in pts], [y for _, y in pts], "^:", color="tab:red")
    p99.set_ylabel("new keys p99 ms", color="tab:red")
    ax.legend(loc="upper left", fontsize=7)


def waiting(ax, c):
    ax.set_title("6. waiting retries: per waiter")
    w = [x["waiters"] for x in c["points"]]
    ax.plot(w, [x["envoy_kib_per_waiter"] for x in c["points"]], "o-", label="Envoy KiB")
    ax.plot(w, [x["state_api_kib_per_waiter"] for x in c["points"]], "s-", label="state API KiB")
    ax.set_xscale("log")
    ax.set_xlabel("waiters")
    ax.set_ylabel("KiB per waiter")
    last = ax.twinx()
    last.plot(w, [x["last_replay_after_ms"] for x in c["points"]], "^:", color="tab:red")
    last.set_ylabel("last replay after completion, ms", color="tab:red")
    ax.legend(loc="upper left", fontsize=7)


def main(src, dst):
    with open(src) as f:
        report = json.load(f)
    curves = report.get("curves", {})
    fig, axes = plt.subplots(3, 2, figsize=(14, 14))
    panels = [("records", records, "1. records in the table"), ("steady", steady, "2. steady state"),
              ("body", body, "3. body size"), ("routes", routes, "4. routes"),
              ("clients", clients, "5. clients"), ("waiting", waiting, "6. waiting retries")]
    for ax, (name, draw, title) in zip(axes.flat, panels):
        if name in curves:
            draw(ax, curves[name])
        else:
            empty(ax, title)
        ax.grid(True, alpha=0.3)
    measured = report.get("measured", {})
    quick = " (quick: smoke versions)" if any(m.get("quick") for m in measured.values()) else ""
    fig.suptitle(f"make bench-scale{quick}, {report['git']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
