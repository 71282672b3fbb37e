//! The report of `bench scale`: docs/scale.json, docs/scale.png and the section of
//! docs/BENCH.md between `<!-- scale -->` and `<!-- /scale -->`.
//!
//! A run of some curves (`SCALE_CURVES`) keeps what the report already holds of the others:
//! every curve's figures, goals and text carry the commit and the time they were measured at,
//! so that a curve measured apart (the half-hour steady state, the records at 50 M rows) and
//! the rest measured in another run make one report that says which is which. A curve that
//! failed to run this time is reported failed, not left at its older figures. A quick run
//! (`QUICK=1`) writes elsewhere (target/scale-quick/) and never merges with a full one.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{table, CurveOutput, Goal, Quiet, Settings, CURVES};
use crate::bench_doc::{splice_between, SCALE_BEGIN as BEGIN, SCALE_END as END};
use crate::plot_script;

/// This run: what it was asked for, where, and how long it took.
pub struct Run {
    pub git: String,
    pub settings: Settings,
    pub total_s: f64,
}

/// When and where a curve's figures were measured, with its goals and its Markdown.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Measured {
    unix_s: u64,
    git: String,
    quick: bool,
    total_s: f64,
    goals: Vec<Goal>,
    markdown: String,
}

/// scale.json. `curves` and `quiet` are keyed by curve (bench/plot_scale.py reads `curves`);
/// `goals` are every kept curve's, in the curves' order.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
struct ScaleReport {
    generated_unix_s: u64,
    git: String,
    curves: BTreeMap<String, serde_json::Value>,
    quiet: BTreeMap<String, Quiet>,
    measured: BTreeMap<String, Measured>,
    goals: Vec<Goal>,
    /// Curves that failed to run in the last run, with why.
    failed: BTreeMap<String, String>,
}

/// The report of `run`, keeping from `earlier` the curves this run did not measure.
fn merged(
    run: &Run,
    outputs: &[CurveOutput],
    failed: &BTreeMap<String, String>,
    earlier: ScaleReport,
) -> ScaleReport {
    let unix_s = crate::report::unix_now_s();
    let mut report = ScaleReport {
        generated_unix_s: unix_s,
        git: run.git.clone(),
        failed: failed.clone(),
        ..ScaleReport::default()
    };
    for name in CURVES {
        let this_run = outputs.iter().find(|o| o.name == name);
        if let Some(o) = this_run {
            report.curves.insert(name.to_owned(), o.json.clone());
            report.quiet.insert(name.to_owned(), o.quiet.clone());
            report.measured.insert(
                name.to_owned(),
                Measured {
                    unix_s,
                    git: run.git.clone(),
                    quick: run.settings.quick,
                    total_s: run.total_s,
                    goals: o.goals.clone(),
                    markdown: o.markdown.clone(),
                },
            );
        } else if !run.settings.wants(name) {
            let kept = (
                earlier.curves.get(name),
                earlier.quiet.get(name),
                earlier.measured.get(name),
            );
            if let (Some(json), Some(quiet), Some(m)) = kept {
                if m.quick == run.settings.quick {
                    report.curves.insert(name.to_owned(), json.clone());
                    report.quiet.insert(name.to_owned(), quiet.clone());
                    report.measured.insert(name.to_owned(), m.clone());
                }
            }
        }
    }
    for name in CURVES {
        if let Some(m) = report.measured.get(name) {
            report.goals.extend(m.goals.iter().cloned());
        }
        if let Some(why) = failed.get(name) {
            report.goals.push(Goal::failed_to_run(name, why));
        }
    }
    report
}

/// Writes scale.json, scale.png and the section of BENCH.md into `out_dir`, keeping the curves
/// this run did not measure from the scale.json already there.
pub fn write(
    run: &Run,
    outputs: &[CurveOutput],
    failed: &BTreeMap<String, String>,
    out_dir: &Path,
) -> Result<(), String> {
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let json = out_dir.join("scale.json");
    // An older report in another shape is not merged (its curves are measured again).
    let earlier = std::fs::read_to_string(&json)
        .ok()
        .and_then(|t| serde_json::from_str::<ScaleReport>(&t).ok())
        .unwrap_or_default();
    let report = merged(run, outputs, failed, earlier);
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(&json, text + "\n").map_err(|e| e.to_string())?;
    let png = out_dir.join("scale.png");
    plot_script("plot_scale.py", &json, &png);
    let md = out_dir.join("BENCH.md");
    let doc = std::fs::read_to_string(&md).unwrap_or_default();
    std::fs::write(&md, splice_between(&doc, &markdown(&report), BEGIN, END))
        .map_err(|e| e.to_string())?;
    eprintln!(
        "bench scale: wrote {}, {} and its section of {} ({} of {} curves measured)",
        json.display(),
        png.display(),
        md.display(),
        report.measured.len(),
        CURVES.len()
    );
    Ok(())
}

/// A Unix time as `YYYY-MM-DD HH:MM UTC`.
fn utc(unix_s: u64) -> String {
    i64::try_from(unix_s)
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
        .map_or_else(
            || format!("{unix_s} s after the epoch"),
            |t| t.format("%Y-%m-%d %H:%M UTC").to_string(),
        )
}

fn markdown(report: &ScaleReport) -> String {
    let quick = report.measured.values().any(|m| m.quick);
    let mut out = format!(
        "{BEGIN}\n## How the cost grows (`make bench-scale`)\n\nGenerated by `make bench-scale` (bench/src/scale/, issue 38){}; raw figures in [scale.json](scale.json), plots in [scale.png](scale.png). Each curve is measured against its own first point in the same run, on this 2-core machine shared by the load generator, Envoy, the checkout, the state API and Postgres; a run of some curves (`SCALE_CURVES`) keeps the others' last figures, and each curve says when and at which commit it was measured. How quiet the machine was is given for each curve: figures from a run with steal or other work above {} cores are noise.\n\n### Goals\n\n{}\n",
        if quick {
            ", **quick version** (`QUICK=1`: the machinery's smoke test, not the curves)"
        } else {
            ""
        },
        crate::NOISY_CORES,
        goals_table(&report.goals, true)
    );
    for name in CURVES {
        if let (Some(m), Some(quiet)) = (report.measured.get(name), report.quiet.get(name)) {
            out += &format!(
                "\n{}\n_Measured {} at {} (a run of {:.0} s); {}._\n",
                m.markdown.trim_end(),
                utc(m.unix_s),
                m.git,
                m.total_s,
                quiet.describe()
            );
        }
    }
    for (curve, why) in &report.failed {
        out += &format!("\n### {curve}\n\nThe curve failed to run: {why}\n");
    }
    let missing: Vec<&str> = CURVES
        .iter()
        .copied()
        .filter(|c| !report.measured.contains_key(*c) && !report.failed.contains_key(*c))
        .collect();
    if !missing.is_empty() {
        out += &format!(
            "\nNot measured yet: {} (`SCALE_CURVES={} make bench-scale`).\n",
            missing.join(", "),
            missing.join(",")
        );
    }
    out += &format!("\n![scale](scale.png)\n{END}\n");
    out
}

pub fn goals_table(goals: &[Goal], md: bool) -> String {
    let head = ["curve", "goal", "target", "measured", ""];
    let rows: Vec<Vec<String>> = goals
        .iter()
        .map(|g| {
            vec![
                g.curve.clone(),
                g.goal.clone(),
                g.target.clone(),
                g.measured.clone(),
                g.verdict().to_owned(),
            ]
        })
        .collect();
    table(&head, &rows, md)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(name: &'static str, figure: u64) -> CurveOutput {
        CurveOutput {
            name,
            json: serde_json::json!({ "figure": figure }),
            goals: vec![Goal::new(name, "g", "t", figure.to_string(), Some(true))],
            markdown: format!("### {name}\n\nfigure {figure}\n"),
            quiet: Quiet::default(),
        }
    }

    fn run(curves: &[&str]) -> Run {
        Run {
            git: "abc".into(),
            settings: Settings {
                quick: false,
                curves: curves.iter().map(|c| (*c).to_owned()).collect(),
            },
            total_s: 1.0,
        }
    }

    #[test]
    fn a_run_of_some_curves_keeps_the_others_and_replaces_its_own() {
        let first = merged(
            &run(&["body", "routes"]),
            &[output("body", 1), output("routes", 2)],
            &BTreeMap::new(),
            ScaleReport::default(),
        );
        let text = serde_json::to_string(&first).unwrap_or_default();
        let earlier: ScaleReport = serde_json::from_str(&text).unwrap_or_default();
        let mut failed = BTreeMap::new();
        failed.insert("steady".to_owned(), "it broke".to_owned());
        let second = merged(
            &run(&["routes", "steady"]),
            &[output("routes", 3)],
            &failed,
            earlier,
        );
        assert_eq!(second.curves["body"]["figure"], 1, "kept");
        assert_eq!(second.curves["routes"]["figure"], 3, "measured again");
        assert!(!second.curves.contains_key("steady"), "failed: not kept");
        let measured: Vec<&str> = second.goals.iter().map(|g| g.measured.as_str()).collect();
        assert_eq!(measured, ["1", "3", "it broke"], "in the curves' order");
        let md = markdown(&second);
        assert!(md.contains("figure 1") && md.contains("figure 3") && !md.contains("figure 2"));
        assert!(
            md.contains("Not measured yet: clients, waiting, records"),
            "{md}"
        );
    }

    #[test]
    fn times_are_printed_in_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc(1_796_478_360), "2026-12-05 13:46 UTC");
    }
}
